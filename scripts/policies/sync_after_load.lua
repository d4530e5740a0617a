-- sync_after_load.lua: after a model-only or external load, re-sync every fp32 master from the
-- model's params before the next step.
--
-- A master copy that disagrees with the params it stands for silently undoes a load: the next step
-- updates the old master and writes it back over the loaded weights. Offloaded (CPU) masters are the
-- ones nothing else refreshes. This policy makes every master, CPU and GPU alike, agree with the
-- model after any load that did not restore the masters themselves, at the price of re-deriving
-- them from the low-precision params (the masters of groups the load did not touch are rounded to
-- their params' precision too).
--
-- Built on offload_fraction.lua (ferry.policy): its place() is offload_fraction's, unchanged, and
-- this file overrides only after_load().
--
-- Args:
--   fraction         as in offload_fraction.lua: the share of parameter elements offloaded, a
--                    number in [0, 1], default 0.5.
--   numa             optional NUMA mode for the pinned arena, as in offload_fraction.lua.
--   reset_optimizer  "auto" (default): reset the Adam moments when the load did not restore them;
--                    "always"; "never".
--
-- place(): offload_fraction.lua's (see there).
--
-- after_load():
--   sync: "all" (every group) when event.kind is "model_only" or "external", or when
--         event.masters_loaded is false; otherwise (a checkpoint that restored the masters of every
--         group it loaded) "none": the groups it did not load kept both params and masters.
--   reset_optimizer: per the arg; "auto" is `not event.optimizer_loaded`.
--
-- checkpoint(): the engine's defaults (not defined here; offload_fraction's is not taken over).

-- No args table: the base shares this policy's args (it sees fraction, from and numa, the ones it takes).
local base = ferry.policy("offload_fraction")

local M = { place = base.place }

function M.after_load(event, ctx)
  local mode = ctx.args.reset_optimizer or "auto"
  local reset
  if mode == "auto" then
    reset = not event.optimizer_loaded
  elseif mode == "always" then
    reset = true
  elseif mode == "never" then
    reset = false
  else
    error(string.format("args.reset_optimizer must be \"auto\", \"always\" or \"never\", got %q",
                        tostring(mode)), 0)
  end
  local sync = "none"
  if event.kind == "model_only" or event.kind == "external" or not event.masters_loaded then
    sync = "all"
  end
  return { sync = sync, reset_optimizer = reset }
end

-- The base's args (fraction, from, numa) and this file's own.
M.args = base.args
M.args.reset_optimizer = "auto (default): reset Adam when the load did not restore it; always; never"

return M
