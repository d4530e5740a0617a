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

-- A small deterministic generator, so every run sees the same data.
local seed = 12345
local function rand()  -- uniform in [-1, 1)
  seed = (seed * 1103515245 + 12345) % 2147483648
  return seed / 1073741824 - 1
end

local true_w, true_b = {}, 0.5
for j = 1, FEATURES do true_w[j] = math.sin(j) end
local xs, ys = {}, {}
for i = 1, SAMPLES do
  local x, y = {}, true_b
  for j = 1, FEATURES do x[j] = rand(); y = y + x[j] * true_w[j] end
  xs[i], ys[i] = x, y
end

-- Builds the model's device tensors and an engine over them.
local function build(init_seed)
  seed = init_seed
  local engine = ferry.engine{ policy = policy, args = { fraction = 0.5 }, lr = 0.05, weight_decay = 0.0 }
  local model = { w = {}, gw = {}, b = nil, gb = nil, engine = engine }
  local per = FEATURES / GROUPS
  for g = 1, GROUPS do
    local w, gw = ferry.tensor("bf16", per), ferry.tensor("bf16", per)
    local init = {}
    for j = 1, per do init[j] = 0.1 * rand() end
    w:upload(init)
    engine:add_param{ name = "layer" .. (g - 1) .. ".weight", group = "layer" .. (g - 1), shape = { per },
                      dtype = "bf16", param = w, grad = gw }
    model.w[g], model.gw[g] = w, gw
  end
  model.b, model.gb = ferry.tensor("bf16", 1), ferry.tensor("bf16", 1)
  engine:add_param{ name = "head.bias", group = "head", shape = { 1 }, param = model.b, grad = model.gb }
  engine:finalize()
  return model
end

-- Forward and backward on the host in double precision: returns the loss and uploads the grads.
local function forward_backward(model)
  local per = FEATURES / GROUPS
  local w = {}
  for g = 1, GROUPS do
    local part = model.w[g]:download()
    for j = 1, per do w[(g - 1) * per + j] = part[j] end
  end
  local b = model.b:download()[1]
  local gw, gb, loss = {}, 0, 0
  for j = 1, FEATURES do gw[j] = 0 end
  for i = 1, SAMPLES do
    local x = xs[i]
    local pred = b
    for j = 1, FEATURES do pred = pred + x[j] * w[j] end
    local err = pred - ys[i]
    loss = loss + err * err
    for j = 1, FEATURES do gw[j] = gw[j] + 2 * err * x[j] / SAMPLES end
    gb = gb + 2 * err / SAMPLES
  end
  for g = 1, GROUPS do
    local part = {}
    for j = 1, per do part[j] = gw[(g - 1) * per + j] end
    model.gw[g]:upload(part)
  end
  model.gb:upload({ gb })
  return loss / SAMPLES
end

local function snapshot(model)
  local parts = {}
  for g = 1, GROUPS do parts[g] = model.w[g]:raw() end
  parts[#parts + 1] = model.b:raw()
  return table.concat(parts)
end

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
  model.w[1]:download()[1], true_w[1], model.b:download()[1], true_b))
if own_root then os.execute("rm -rf '" .. root .. "'") end
