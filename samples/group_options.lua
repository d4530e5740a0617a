-- Per-group optimizer settings from a script, and the module's step, stats and load options.
--
--   ferry run samples/group_options.lua
--
-- Two fp32 params: "w" (group "weights", the engine's weight decay 0.1) and "b" (group "no_decay":
-- no weight decay, half the learning rate). With zero grads Adam's update is zero and only AdamW's
-- decay moves a param: w shrinks by lr * 0.1 * w per step, b stays exactly as it was. Then: an
-- unknown option name and a negative weight decay are refused; a NaN grad skips a step (stats);
-- a checkpoint loaded by an engine whose "no_decay" group decays reports the difference.
--
-- Any failure raises an error, so `ferry run` exits non-zero.
local ferry = require("ferry")

local LR, N = 0.01, 8

local function make(no_decay_options)
  local e = ferry.engine{ lr = LR, weight_decay = 0.1 }
  -- Bad settings: refused with a clear error, nothing recorded.
  local ok, err = pcall(e.add_group, e, "no_decay", { weight_decay_typo = 0 })
  assert(not ok and err:find("unknown group option 'weight_decay_typo'"), err)
  ok, err = pcall(e.add_group, e, "no_decay", { weight_decay = -1 })
  assert(not ok and err:find("weight_decay is %-1"), err)
  ok, err = pcall(e.add_group, e, "no_decay", { beta2 = 1 })
  assert(not ok and err:find("beta2 is 1"), err)
  e:add_group("no_decay", no_decay_options)
  local t = {}
  for _, p in ipairs{ { "w", "weights" }, { "b", "no_decay" } } do
    local param, grad = ferry.tensor("f32", N), ferry.tensor("f32", N)
    local init = {}
    for i = 1, N do init[i] = 0.5 + i / N end
    param:upload(init)
    e:add_param{ name = p[1], group = p[2], shape = { N }, param = param, grad = grad }
    t[p[1]] = { param = param, grad = grad, init = init }
  end
  e:finalize()
  return e, t
end

local e, t = make({ weight_decay = 0, lr_scale = 0.5 })
for _, g in ipairs(e:placement()) do
  if g.group == "no_decay" then
    assert(g.weight_decay == 0 and g.lr_scale == 0.5 and g.adamw == true, "no_decay settings")
  else
    assert(math.abs(g.weight_decay - 0.1) < 1e-7 and g.lr_scale == 1, "weights settings")
  end
end

local skipped = e:step{ lr = LR, loss_scale = 2, check_finite = true }  -- zero grads: only the decay acts
assert(skipped == false)
local w, b = t.w.param:download(), t.b.param:download()
for i = 1, N do
  local want = t.w.init[i] - LR * 0.1 * t.w.init[i]
  assert(math.abs(w[i] - want) < 1e-6 * math.abs(want), ("w[%d] = %g, want %g"):format(i, w[i], want))
  assert(math.abs(b[i] - t.b.init[i]) < 1e-7, ("b[%d] moved: %g, was %g"):format(i, b[i], t.b.init[i]))
end

-- A NaN grad skips the whole step; stats report it.
local nan = {}
for i = 1, N do nan[i] = (i == 3) and 0 / 0 or 1 end
t.b.grad:upload(nan)
assert(e:step() == true, "the NaN step was not skipped")
local stats = e:stats()
assert(stats.skipped_steps == 1 and stats.last_step_skipped == true and stats.step == 1, "stats")
local ok, err = pcall(e.step, e, { lr = LR, max_grad_nrom = 1 })
assert(not ok and err:find("unknown option 'max_grad_nrom'"), err)
t.b.grad:upload((function() local z = {} for i = 1, N do z[i] = 0 end return z end)())

-- A checkpoint loaded by an engine whose "no_decay" group decays: the difference is reported.
local tmp = os.tmpname()
os.remove(tmp)
local dir = e:save(tmp .. ".ckpt", 1)
assert(e:poll_checkpoint() == true)
e:wait_checkpoint()
local e2 = make({ weight_decay = 0.01, lr_scale = 0.5 })
local loaded, differences = e2:load(tmp .. ".ckpt", { fall_back_to_previous = true })
assert(loaded == dir, loaded)
assert(#differences == 1 and differences[1] == "group 'no_decay': weight_decay 0 in the checkpoint, 0.01 in this engine",
       differences[1])
os.execute("rm -rf '" .. tmp .. ".ckpt'")
print("group_options: OK")
