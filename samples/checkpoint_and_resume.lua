-- Checkpoint and resume, two ways.
--
--   ferry run samples/checkpoint_and_resume.lua [CHECKPOINT_ROOT]
--
-- Part 1, full checkpoints (policy offload_fraction.lua): train, saving at steps 10, 20 and 30 into
-- ROOT/full; then a fresh engine over freshly initialised tensors loads ROOT/full (a root: its
-- `latest`, step 30) and runs 20 more steps, which must be bit-identical to 20 more steps of the
-- original run: params, fp32 masters, Adam moments and step counts all came back.
--
-- Part 2, model-only checkpoints (policy skip_optimizer_on_save.lua, keep_last = 2): while groups
-- are offloaded it writes only the bf16 params, and keeps the two newest checkpoints. Loading one,
-- the policy's after_load() re-initialises Adam and re-syncs every fp32 master from the loaded
-- params: the masters verify, the optimizer's step count starts again from 0, and training goes on
-- from the loaded weights.
--
-- Any failure raises an error, so `ferry run` exits non-zero.
local ferry = require("ferry")

local FEATURES, GROUPS, SAMPLES = 24, 3, 128
local policies = ferry.script_dir .. "/../scripts/policies/"
local root, own_root = arg[1], false
if not root then
  own_root = true
  local tmp = os.tmpname()  -- a fresh unique name; the checkpoints go beside it
  os.remove(tmp)
  root = tmp .. ".ckpt"
end

local regression = dofile(ferry.script_dir .. "/lib/linear_regression.lua")
local problem = regression.new{ ferry = ferry, features = FEATURES, groups = GROUPS, samples = SAMPLES, seed = 7,
                                weight = function(j) return math.sin(2 * j) end, intercept = -0.5, bias = true }

local function build(policy, args, init_seed)
  return problem:build({ policy = policy, args = args, lr = 0.02 }, init_seed)
end
local function forward_backward(model) return problem:forward_backward(model) end
local function snapshot(model) return problem:snapshot(model) end

local function train(model, steps)
  local loss
  for _ = 1, steps do
    loss = forward_backward(model)
    model.engine:step()
  end
  return loss
end

local function exists(path)
  local status = os.execute("test -e '" .. path .. "'")
  return status == 0 or status == true
end

local function read_file(path)
  local f = assert(io.open(path, "rb"))
  local text = f:read("*a")
  f:close()
  return text
end

print(("ferry %s on %s"):format(ferry.version, ferry.device_name()))

-- Part 1: full checkpoints, bit-identical resume.
local full_root = root .. "/full"
local original = build(policies .. "offload_fraction.lua", { fraction = 0.5 }, 31)
for step = 1, 30 do
  forward_backward(original)
  original.engine:step()
  if step % 10 == 0 then print("saved " .. original.engine:save(full_root, step)) end
end
local latest = read_file(full_root .. "/latest"):gsub("%s+$", "")
assert(latest == "step-00000030", "latest names " .. latest)
train(original, 20)
local uninterrupted = snapshot(original)

local resumed = build(policies .. "offload_fraction.lua", { fraction = 0.5 }, 12345)  -- other weights
resumed.engine:load(full_root)
local ok, why = resumed.engine:verify_masters()
assert(ok, why)
assert(resumed.engine:stats().step == 30, "the optimizer step count was not restored")
-- Synchronous saves never copy offloaded state aside (only a step overtaking an async save does).
assert(resumed.engine:stats().checkpoint_copied_aside_bytes == 0)
train(resumed, 20)
if snapshot(resumed) ~= uninterrupted then
  error("the run resumed from " .. latest .. " differs from the uninterrupted run")
end
print("full checkpoint: resumed from " .. latest .. "; the 20 following steps are bit-identical")

-- Part 2: model-only checkpoints while offloading, keep_last = 2.
local lean_root = root .. "/model_only"
local args = { fraction = 0.5, keep_last = 2 }
local lean = build(policies .. "skip_optimizer_on_save.lua", args, 31)
local dirs = {}
for step = 1, 30 do
  forward_backward(lean)
  lean.engine:step()
  if step % 10 == 0 then dirs[#dirs + 1] = lean.engine:save(lean_root, step) end
end
assert(not exists(dirs[1]), "keep_last = 2 should have deleted " .. dirs[1])
assert(exists(dirs[2]) and exists(dirs[3]), "keep_last = 2 should keep the two newest")
local manifest = read_file(dirs[3] .. "/manifest.json")
assert(not manifest:find(":master", 1, true) and not manifest:find(":exp_avg", 1, true),
  "a model-only checkpoint holds no fp32 state")
assert(manifest:find('"optimizer"', 1, true) and manifest:find('"master"', 1, true),
  "the manifest records what was skipped")
print(("model-only checkpoints: kept %s and %s (keep_last = 2), params only"):format(dirs[2], dirs[3]))
local loss_at_save = forward_backward(lean)  -- the loss of the saved weights (no step taken)

local restarted = build(policies .. "skip_optimizer_on_save.lua", args, 999)
restarted.engine:load(lean_root)
ok, why = restarted.engine:verify_masters()
assert(ok, "after a model-only load the masters must be re-synced: " .. tostring(why))
assert(restarted.engine:stats().step == 0, "after a model-only load Adam starts again")
if snapshot(restarted) ~= snapshot(lean) then error("the loaded params differ from the saved ones") end
local first = forward_backward(restarted)
assert(first == loss_at_save, ("loss after loading %.9g, at save %.9g"):format(first, loss_at_save))
local later = train(restarted, 20)
assert(restarted.engine:stats().step == 20)
assert(later < first, ("training after the model-only resume did not go on: %g -> %g"):format(first, later))
print(("model-only resume: Adam re-initialised, masters synced; loss %.6f -> %.6f in 20 steps"):format(
  first, later))

if own_root then os.execute("rm -rf '" .. root .. "'") end
