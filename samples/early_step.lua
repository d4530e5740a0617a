-- Starting the optimizer step during backward: e:grads_ready{...} announces groups whose grads are
-- final, and their offloaded update (D2H, CPU Adam, upload) starts at once in the background; e:step
-- completes the step and keeps the early work only when it was exact.
--
--   ferry run samples/early_step.lua
--
-- Two engines train the same linear regression, every group offloaded: "early" announces its groups
-- in reverse order (as a backward produces them) before each step, "plain" only steps. Clipping is
-- on with a max norm that triggers in some steps (the early work is then recomputed) and not in
-- others (it is kept); the params must be identical bit for bit after every step, whatever happened.
-- Then the same with the whole model in ONE group, announced in buckets of params
-- (e:grads_ready_params{...}, as a trainer with few groups does) and checked with e:wait_params_of.
-- The script fails (non-zero exit) if they are not.
local ferry = require("ferry")

local FEATURES, GROUPS, SAMPLES, STEPS = 24, 4, 128, 40
local policies = ferry.script_dir .. "/../scripts/policies/"
local regression = dofile(ferry.script_dir .. "/lib/linear_regression.lua")
local problem = regression.new{ ferry = ferry, features = FEATURES, groups = GROUPS, samples = SAMPLES, seed = 7,
                                weight = math.sin, intercept = 0.5, bias = true }

local function build() return problem:build({ policy = policies .. "offload_all.lua", lr = 0.05 }, 31) end
local early, plain = build(), build()

local names = {}
for _, p in ipairs(early.engine:placement()) do names[#names + 1] = p.group end

-- Misuses are clear errors: an unknown group, and a group announced twice in one step.
local ok, err = pcall(early.engine.grads_ready, early.engine, { "nope" })
assert(not ok and err:find("no parameter group 'nope'"), err)

local loss
for step = 1, STEPS do
  loss = problem:forward_backward(early)
  problem:forward_backward(plain)
  -- The max norm alternates between clipping and not (the grad norm shrinks as the loss falls).
  local options = { lr = 0.05, max_grad_norm = (step % 3 == 0) and 1e-3 or 1e3 }
  for i = #names, 1, -1 do early.engine:grads_ready({ names[i] }, options) end
  if step == 1 then
    ok, err = pcall(early.engine.grads_ready, early.engine, { names[1] }, options)
    assert(not ok and err:find("already announced"), err)
  end
  early.engine:step(options)
  plain.engine:step(options)
  assert(problem:snapshot(early) == problem:snapshot(plain), ("step %d: the params differ"):format(step))
end
local s = early.engine:stats()
assert(s.early_groups_kept > 0 and s.early_groups_recomputed > 0,
       ("kept %d, recomputed %d"):format(s.early_groups_kept, s.early_groups_recomputed))
print(("loss %.5f after %d steps; early group updates kept %d, recomputed %d; params identical to Step alone")
      :format(loss, STEPS, s.early_groups_kept, s.early_groups_recomputed))

-- One group, announced in buckets: a trainer whose params are all in one group still starts their
-- update during the backward, a bucket of params at a time (the group is announced with its last one).
local whole = regression.new{ ferry = ferry, features = FEATURES, groups = GROUPS, samples = SAMPLES, seed = 7,
                              weight = math.sin, intercept = 0.5, bias = true, one_group = "model" }
local function build_whole() return whole:build({ policy = policies .. "offload_all.lua", lr = 0.05 }, 31) end
local buckets, whole_plain = build_whole(), build_whole()
local params = buckets.names
assert(#buckets.engine:placement() == 1 and #params == GROUPS + 1)

-- Misuses are clear errors, and start nothing: an unknown param, an empty list, a param twice.
ok, err = pcall(buckets.engine.grads_ready_params, buckets.engine, { params[1], "nope" })
assert(not ok and err:find("no param 'nope'"), err)
ok, err = pcall(buckets.engine.grads_ready_params, buckets.engine, {})
assert(not ok and err:find("name at least one param"), err)
ok, err = pcall(buckets.engine.grads_ready_params, buckets.engine, { params[2], params[2] })
assert(not ok and err:find("'" .. params[2] .. "' was already announced"), err)
ok, err = pcall(buckets.engine.wait_params_of, buckets.engine, { "nope" })
assert(not ok and err:find("no param 'nope'"), err)

for step = 1, STEPS do
  loss = whole:forward_backward(buckets)
  whole:forward_backward(whole_plain)
  local options = { lr = 0.05, max_grad_norm = (step % 3 == 0) and 1e-3 or 1e3 }
  -- The backward: buckets of two params, the last first.
  for last = #params, 1, -2 do
    buckets.engine:grads_ready_params({ params[last], params[last - 1] }, options)  -- params[0] is nil: ends the list
    if step == 1 and last == #params then
      ok, err = pcall(buckets.engine.grads_ready_params, buckets.engine, { params[last] }, options)
      assert(not ok and err:find("already announced"), err)
      ok, err = pcall(buckets.engine.wait_params_of, buckets.engine, { params[1] })
      assert(not ok and err:find("call Step first"), err)
    end
  end
  buckets.engine:step(options)
  whole_plain.engine:step(options)
  buckets.engine:wait_params_of(params)
  assert(whole:snapshot(buckets) == whole:snapshot(whole_plain), ("one group, step %d: the params differ"):format(step))
end
s = buckets.engine:stats()
assert(s.early_groups_kept > 0 and s.early_groups_recomputed > 0,
       ("one group in buckets: kept %d, recomputed %d"):format(s.early_groups_kept, s.early_groups_recomputed))
print(("one group in buckets of params: loss %.5f after %d steps; kept %d, recomputed %d; params identical to "
       .. "Step alone"):format(loss, STEPS, s.early_groups_kept, s.early_groups_recomputed))
