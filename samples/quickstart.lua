-- Quickstart: fit a linear regression with a known answer, half of its parameter groups offloaded to
-- the CPU by scripts/policies/offload_fraction.lua, then checkpoint, resume in a fresh engine and check
-- that the resumed run is bit-identical to the uninterrupted one.
--
--   ferry run samples/quickstart.lua [CHECKPOINT_ROOT]
--
-- The model: y = x . w + b with 32 features; w is split into four groups of 8 ("layer0" .. "layer3"),
-- b is its own group. Params and grads are bf16 on the device; the fp32 masters and Adam moments live
-- where the policy placed them (pinned host memory for "cpu", device memory for "gpu").
local ferry = require("ferry")

local FEATURES, GROUPS, SAMPLES = 32, 4, 256
local STEPS, SAVE_AT = 120, 60
local policy = ferry.script_dir .. "/../scripts/policies/offload_fraction.lua"
local root, own_root = arg[1], false
if not root then
  own_root = true
  local tmp = os.tmpname()  -- a fresh unique name; the checkpoints go beside it
  os.remove(tmp)
  root = tmp .. ".ckpt"
end

-- The data: a known answer (w_j = sin j, b = 0.5) on inputs from a small deterministic generator, so
-- every run sees the same data. samples/lib/linear_regression.lua holds the model's tensors and its
-- forward and backward pass (on the host, in double precision).
local regression = dofile(ferry.script_dir .. "/lib/linear_regression.lua")
local true_b = 0.5
local problem = regression.new{ ferry = ferry, features = FEATURES, groups = GROUPS, samples = SAMPLES, seed = 12345,
                                weight = math.sin, intercept = true_b, bias = true }

-- The model's device tensors and an engine over them, initialised from `init_seed`.
local function build(init_seed)
  return problem:build({ policy = policy, args = { fraction = 0.5 }, lr = 0.05, weight_decay = 0.0 }, init_seed)
end
local function forward_backward(model) return problem:forward_backward(model) end
local function snapshot(model) return problem:snapshot(model) end

print(("ferry %s on %s"):format(ferry.version, ferry.device_name()))
local model = build(777)
print("placement (policy offload_fraction, fraction = 0.5):")
for _, p in ipairs(model.engine:placement()) do
  print(("  %-8s %-3s  %d elements"):format(p.group, p.device, p.numel))
end

local first_loss, last_loss, saved_dir
for step = 1, STEPS do
  local loss = forward_backward(model)
  first_loss = first_loss or loss
  last_loss = loss
  model.engine:step()
  if step == 1 or step % 10 == 0 then print(("step %4d  loss %.6f"):format(step, loss)) end
  if step == SAVE_AT then
    saved_dir = model.engine:save(root, step)
    print("saved checkpoint " .. saved_dir)
  end
end
assert(last_loss < 0.01 * first_loss, ("the loss did not go down enough: %g -> %g"):format(first_loss, last_loss))
local ok, why = model.engine:verify_masters()
assert(ok, why)
local uninterrupted = snapshot(model)

-- Resume: a fresh engine over freshly initialised tensors, loaded from the checkpoint, then the same
-- remaining steps on the same data.
local resumed = build(4242)
resumed.engine:load(saved_dir)
ok, why = resumed.engine:verify_masters()
assert(ok, why)
for _ = SAVE_AT + 1, STEPS do
  forward_backward(resumed)
  resumed.engine:step()
end
local again = snapshot(resumed)
if again ~= uninterrupted then
  error("resumed run differs from the uninterrupted one")
end
print(("resume from step %d: the %d following steps are bit-identical to the uninterrupted run"):format(
  SAVE_AT, STEPS - SAVE_AT))
print(("loss %.6f -> %.6f; w[1] = %.4f (true %.4f), b = %.4f (true %.4f)"):format(first_loss, last_loss,
  model.w[1]:download()[1], math.sin(1), model.b:download()[1], true_b))
if own_root then os.execute("rm -rf '" .. root .. "'") end
