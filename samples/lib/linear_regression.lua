-- The linear regression the samples train: y = intercept + sum_j x_j * weight(j), on data from a small
-- deterministic generator (every run sees the same data). The model's w is split into `groups`
-- parameter groups ("layer0" .. ) of bf16 tensors, plus, with `bias = true`, a one-element "head"
-- group; with `one_group = "name"` all of those tensors are params of that one group instead. Forward
-- and backward run on the host in double precision, and the grads are uploaded.
--
--   local regression = dofile(ferry.script_dir .. "/lib/linear_regression.lua")
--   local problem = regression.new{ ferry = ferry, features = 32, groups = 4, samples = 256, seed = 1,
--                                   weight = math.sin, intercept = 0.5, bias = true }
--   local model = problem:build({ policy = ..., args = ..., lr = 0.05 }, 777)  -- 777: init seed
--   local loss = problem:forward_backward(model); model.engine:step()
--   local bytes = problem:snapshot(model)  -- every param's raw bytes, for bit-exact comparisons
local M = {}
M.__index = M

-- Uniform in [-1, 1), from the problem's own generator state.
function M:rand()
  self.seed = (self.seed * 1103515245 + 12345) % 2147483648
  return self.seed / 1073741824 - 1
end

function M.new(o)
  local p = setmetatable({ ferry = o.ferry, features = o.features, groups = o.groups, samples = o.samples,
                           seed = o.seed, bias = o.bias or false, one_group = o.one_group, xs = {}, ys = {} }, M)
  assert(p.features % p.groups == 0, "features must split evenly into groups")
  for i = 1, p.samples do
    local x, y = {}, o.intercept or 0
    for j = 1, p.features do x[j] = p:rand(); y = y + x[j] * o.weight(j) end
    p.xs[i], p.ys[i] = x, y
  end
  return p
end

-- Device tensors initialised from `init_seed` (0.1 * uniform), and an engine over them.
function M:build(engine_options, init_seed)
  self.seed = init_seed
  local ferry = self.ferry
  local engine = ferry.engine(engine_options)
  local model = { w = {}, gw = {}, names = {}, engine = engine }  -- names: the params', in order
  local per = self.features / self.groups
  for g = 1, self.groups do
    local w, gw = ferry.tensor("bf16", per), ferry.tensor("bf16", per)
    local init = {}
    for j = 1, per do init[j] = 0.1 * self:rand() end
    w:upload(init)
    engine:add_param{ name = "layer" .. (g - 1) .. ".weight", group = self.one_group or ("layer" .. (g - 1)),
                      shape = { per }, param = w, grad = gw }
    model.w[g], model.gw[g] = w, gw
    model.names[g] = "layer" .. (g - 1) .. ".weight"
  end
  if self.bias then
    model.b, model.gb = ferry.tensor("bf16", 1), ferry.tensor("bf16", 1)
    engine:add_param{ name = "head.bias", group = self.one_group or "head", shape = { 1 }, param = model.b,
                      grad = model.gb }
    model.names[#model.names + 1] = "head.bias"
  end
  engine:finalize()
  return model
end

-- The mean squared error of the model's current params; uploads its gradient.
function M:forward_backward(model)
  local per = self.features / self.groups
  local w = {}
  for g = 1, self.groups do
    local part = model.w[g]:download()
    for j = 1, per do w[(g - 1) * per + j] = part[j] end
  end
  local b = self.bias and model.b:download()[1] or 0
  local gw, gb, loss = {}, 0, 0
  for j = 1, self.features do gw[j] = 0 end
  for i = 1, self.samples do
    local x = self.xs[i]
    local pred = b
    for j = 1, self.features do pred = pred + x[j] * w[j] end
    local err = pred - self.ys[i]
    loss = loss + err * err
    for j = 1, self.features do gw[j] = gw[j] + 2 * err * x[j] / self.samples end
    gb = gb + 2 * err / self.samples
  end
  for g = 1, self.groups do
    local part = {}
    for j = 1, per do part[j] = gw[(g - 1) * per + j] end
    model.gw[g]:upload(part)
  end
  if self.bias then model.gb:upload({ gb }) end
  return loss / self.samples
end

-- Every param's raw bytes, concatenated.
function M:snapshot(model)
  local parts = {}
  for g = 1, self.groups do parts[g] = model.w[g]:raw() end
  if self.bias then parts[#parts + 1] = model.b:raw() end
  return table.concat(parts)
end

return M
