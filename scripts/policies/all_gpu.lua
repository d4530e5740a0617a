-- all_gpu.lua: keep every parameter group on the GPU.
--
-- place(): every group's fp32 master copy and Adam state stay in GPU memory; nothing is offloaded,
-- so the engine behaves like a plain fused GPU Adam. Useful as a baseline to compare offloading
-- policies against, and for models that fit.
-- after_load() and checkpoint(): the engine's defaults (not defined here).
-- Args: none.

local M = {}

M.args = {}  -- takes none: any arg is refused

function M.place(groups, ctx)
  local placement = {}
  for _, g in ipairs(groups) do
    placement[g.name] = "gpu"
  end
  return placement
end

return M
