-- offload_all.lua: offload every parameter group to pinned host memory.
--
-- place(): every group's fp32 master copy and Adam state live in pinned host memory and step on the
-- CPU (grads down, params up over PCIe); the GPU keeps only the low-precision params and grads.
-- after_load() and checkpoint(): the engine's defaults (not defined here).
-- Args:
--   numa  optional NUMA mode for the pinned arena: "interleave", "bind", "preferred" or "local"
--         (default: the engine's choice).

local M = {}

function M.place(groups, ctx)
  local placement = {}
  for _, g in ipairs(groups) do
    placement[g.name] = "cpu"
  end
  if ctx.args.numa ~= nil then placement.numa = ctx.args.numa end  -- validated by the engine
  return placement
end

M.args = {
  numa = "NUMA mode of the pinned arena: interleave, bind, preferred or local (default: the engine's)",
}

return M
