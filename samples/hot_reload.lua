-- Hot reload: change the offload policy of a running engine between steps, and check that the run
-- continues bit-identically to one that never moved anything.
--
--   ferry run samples/hot_reload.lua
--
-- Two engines train the same linear regression from the same initial weights on the same data:
-- "moving" starts with offload_fraction (the first group on the CPU) and has its policy reloaded
-- three times (all_gpu, offload_all, memory_budget); "steady" keeps offload_fraction throughout.
-- Each reload moves the fp32 masters and Adam moments of the groups whose placement changed between
-- pinned host memory and the device; no value changes, so after every phase both engines' params
-- must be identical bit for bit. The script fails (non-zero exit) if they are not.
local ferry = require("ferry")

local FEATURES, GROUPS, SAMPLES, PHASE_STEPS = 24, 3, 128, 15
local policies = ferry.script_dir .. "/../scripts/policies/"

-- A small deterministic generator, so every run sees the same data.
local seed = 2024
local function rand()  -- uniform in [-1, 1)
  seed = (seed * 1103515245 + 12345) % 2147483648
  return seed / 1073741824 - 1
end

local xs, ys = {}, {}
for i = 1, SAMPLES do
  local x, y = {}, 0.25
  for j = 1, FEATURES do x[j] = rand(); y = y + x[j] * math.cos(j) end
  xs[i], ys[i] = x, y
end

-- Device tensors for w (GROUPS groups of FEATURES / GROUPS) and b, and an engine over them.
local function build(policy, args)
  seed = 99  -- the same initial weights for every engine
  local engine = ferry.engine{ policy = policy, args = args, lr = 0.02 }
  local model = { w = {}, gw = {}, engine = engine }
  local per = FEATURES / GROUPS
  for g = 1, GROUPS do
    local w, gw = ferry.tensor("bf16", per), ferry.tensor("bf16", per)
    local init = {}
    for j = 1, per do init[j] = 0.1 * rand() end
    w:upload(init)
    engine:add_param{ name = "layer" .. (g - 1) .. ".weight", group = "layer" .. (g - 1),
                      shape = { per }, param = w, grad = gw }
    model.w[g], model.gw[g] = w, gw
  end
  model.b, model.gb = ferry.tensor("bf16", 1), ferry.tensor("bf16", 1)
  engine:add_param{ name = "head.bias", group = "head", shape = { 1 }, param = model.b, grad = model.gb }
  engine:finalize()
  return model
end

-- Mean squared error and its gradient, in double precision on the host; uploads the grads.
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
    local pred = b
    for j = 1, FEATURES do pred = pred + xs[i][j] * w[j] end
    local err = pred - ys[i]
    loss = loss + err * err
    for j = 1, FEATURES do gw[j] = gw[j] + 2 * err * xs[i][j] / SAMPLES end
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
-- elements on the device: it offloads the largest groups until the rest fits.
local phases = {
  { name = "offload_fraction.lua", args = { fraction = 0.5 }, expect = "cpu gpu gpu gpu" },
  { name = "all_gpu.lua", args = {}, expect = "gpu gpu gpu gpu" },
  { name = "offload_all.lua", args = {}, expect = "cpu cpu cpu cpu" },
  { name = "memory_budget.lua", args = { budget = "200", reserve = "0" }, expect = "cpu cpu gpu gpu" },
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
