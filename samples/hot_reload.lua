-- Hot reload: change the offload policy of a running engine between steps, and check that the run
-- continues bit-identically to one that never moved anything.
--
--   ferry run samples/hot_reload.lua
--
-- Two engines train the same linear regression from the same initial weights on the same data:
-- "moving" starts with offload_fraction (the last two groups on the CPU) and has its policy reloaded
-- three times (all_gpu, offload_all, memory_budget); "steady" keeps offload_fraction throughout.
-- Each reload moves the fp32 masters and Adam moments of the groups whose placement changed between
-- pinned host memory and the device; no value changes, so after every phase both engines' params
-- must be identical bit for bit. The script fails (non-zero exit) if they are not.
local ferry = require("ferry")

local FEATURES, GROUPS, SAMPLES, PHASE_STEPS = 24, 3, 128, 15
local policies = ferry.script_dir .. "/../scripts/policies/"

-- The shared linear regression (samples/lib), on its own data.
local regression = dofile(ferry.script_dir .. "/lib/linear_regression.lua")
local problem = regression.new{ ferry = ferry, features = FEATURES, groups = GROUPS, samples = SAMPLES, seed = 2024,
                                weight = math.cos, intercept = 0.25, bias = true }

-- Every engine starts from the same initial weights (seed 99).
local function build(policy, args)
  return problem:build({ policy = policy, args = args, lr = 0.02 }, 99)
end
local function forward_backward(model) return problem:forward_backward(model) end
local function snapshot(model) return problem:snapshot(model) end

local function placement_line(model)
  local cells = {}
  for _, p in ipairs(model.engine:placement()) do cells[#cells + 1] = p.group .. "=" .. p.device end
  local s = model.engine:stats()
  return ("%s   (state: %d B pinned, %d B on the device)"):format(table.concat(cells, " "),
    s.pinned_bytes, s.gpu_state_bytes)
end

local function train(model, steps)
  local loss
  for _ = 1, steps do
    loss = forward_backward(model)
    model.engine:step()
  end
  return loss
end

print(("ferry %s on %s"):format(ferry.version, ferry.device_name()))
local moving = build(policies .. "offload_fraction.lua", { fraction = 0.5 })
local steady = build(policies .. "offload_fraction.lua", { fraction = 0.5 })

-- Each phase: reload (except the first), train both for PHASE_STEPS, compare bit for bit.
-- memory_budget with a budget of 200 bytes holds the state (12 B per element) of at most 16
-- elements on the device: it offloads the last groups until the rest fits.
local phases = {
  { name = "offload_fraction.lua", args = { fraction = 0.5 }, expect = "gpu gpu cpu cpu" },
  { name = "all_gpu.lua", args = {}, expect = "gpu gpu gpu gpu" },
  { name = "offload_all.lua", args = {}, expect = "cpu cpu cpu cpu" },
  { name = "memory_budget.lua", args = { budget = "200", reserve = "0" }, expect = "gpu gpu cpu cpu" },
}
for i, phase in ipairs(phases) do
  if i > 1 then
    moving.engine:reload_policy{ path = policies .. phase.name, args = phase.args }
  end
  local devices = {}
  for _, p in ipairs(moving.engine:placement()) do devices[#devices + 1] = p.device end
  if table.concat(devices, " ") ~= phase.expect then
    error(("after reloading %s the placement is %s, expected %s"):format(phase.name,
      table.concat(devices, " "), phase.expect))
  end
  print(("phase %d, policy %s:"):format(i, phase.name))
  print("  moving: " .. placement_line(moving))
  local loss_moving = train(moving, PHASE_STEPS)
  local loss_steady = train(steady, PHASE_STEPS)
  local ok, why = moving.engine:verify_masters()
  assert(ok, why)
  if snapshot(moving) ~= snapshot(steady) then
    error(("phase %d (%s): the params differ from the run that never moved"):format(i, phase.name))
  end
  print(("  %d steps: loss %.6f, params bit-identical to the steady run (loss %.6f)"):format(
    PHASE_STEPS, loss_moving, loss_steady))
end
print(("hot reload: %d policy changes in %d steps; after each phase the params were bit-identical"
  .. " to the run that never moved"):format(#phases - 1, #phases * PHASE_STEPS))
