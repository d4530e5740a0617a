-- lean_offload.lua: offload_fraction, but skip the Adam moments on save.
local base = ferry.policy("offload_fraction", { fraction = "0.25" })

local M = {
  place = base.place,            -- offload_fraction's rule, with fraction 0.25
  after_load = base.after_load,  -- offload_fraction's re-sync after a load
  args = base.args,              -- numa (shared with the base) ...
}
M.args.keep_last = "checkpoints to keep (default 0: all)"  -- ... and this file's own

function M.checkpoint(info, ctx)
  local plan = base.checkpoint(info, ctx)          -- the base's plan, with the base's args
  plan.skip = { "optimizer" }                      -- then skip the moments
  plan.keep_last = tonumber(ctx.args.keep_last or "0")
  return plan
end

return M
