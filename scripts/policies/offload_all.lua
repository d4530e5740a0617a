-- offload_all.lua: offload every parameter group to pinned host memory.
--
-- place(): every group's fp32 master copy and Adam state live in pinned host memory and step on the
-- CPU (grads down, params up over PCIe); the GPU keeps only the low-precision params and grads.
-- This is offload_fraction.lua's place() with fraction = 1, taken over through ferry.policy.
-- after_load() and checkpoint(): the engine's defaults (not defined here).
-- Args:
--   numa  optional NUMA mode for the pinned arena: "interleave", "bind", "preferred" or "local"
--         (default: the engine's choice).

-- fraction is fixed here; the base's other arg (numa) is shared with this policy's args.
local base = ferry.policy("offload_fraction", { fraction = "1" })

return { place = base.place, args = base.args }
