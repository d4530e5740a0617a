-- offload_bf16_moments.lua: offload every parameter group with its Adam moments in bf16.
--
-- Host memory per offloaded param: 4 B of fp32 master + 2 B of m + 2 B of v = 8 B (12 B with fp32
-- moments), plus the engine's constant staging ring; CPU Adam moves 20 B per param instead of 28.
--
-- Args:
--   device    "cpu" (default): every group offloaded; "gpu": every group on the GPU (bf16 moments on
--             the GPU, 8 B of device memory per param instead of 12).
--   rounding  "nearest" (default) or "stochastic": how updated moments (and a bf16 master) are
--             rounded into bf16. Stochastic rounding is unbiased and deterministic (a counter-based
--             hash of the param, its global element, the step and the tensor): bit-identical on
--             every CPU path, on the GPU and for any number of ranks.
--   master    "fp32" (default) or "bf16": a bf16 master for the groups whose params are bf16 (6 B
--             per param); fp32 groups keep an fp32 master. With a bf16 master use
--             rounding = "stochastic": rounding to nearest would drop every update smaller than half
--             a bf16 step, every step.
--   numa      optional NUMA mode for the pinned arena (as offload_all.lua).
--
-- place(), the exact rule: every group gets { device = args.device, moments = "bf16",
--   master = args.master if the group's dtype is bf16 else "fp32", rounding = args.rounding }.
-- after_load() and checkpoint(): the engine's defaults (not defined here).

local M = {}

M.args = {
  device = "cpu (default): every group offloaded; gpu: every group on the GPU",
  rounding = "nearest (default) or stochastic: how bf16 state is rounded",
  master = "fp32 (default) or bf16: a bf16 master for the bf16 groups",
  numa = "NUMA mode of the pinned arena: interleave, bind, preferred or local (default: the engine's)",
}

local function choice(args, name, default, allowed)
  local v = args[name]
  if v == nil then return default end
  for _, a in ipairs(allowed) do
    if v == a then return v end
  end
  error(string.format("args.%s must be one of %s, got %q", name, table.concat(allowed, ", "), tostring(v)), 0)
end

function M.place(groups, ctx)
  local device = choice(ctx.args, "device", "cpu", { "cpu", "gpu" })
  local rounding = choice(ctx.args, "rounding", "nearest", { "nearest", "stochastic" })
  local master = choice(ctx.args, "master", "fp32", { "fp32", "bf16" })
  local placement = {}
  for _, g in ipairs(groups) do
    placement[g.name] = {
      device = device,
      moments = "bf16",
      master = (g.dtype == "bf16") and master or "fp32",
      rounding = rounding,
    }
  end
  if ctx.args.numa ~= nil then placement.numa = ctx.args.numa end  -- validated by the engine
  return placement
end

return M
