-- skip_optimizer_on_save.lua: model-only checkpoints while offloading; a resume re-initialises the
-- optimizer and re-derives the fp32 masters from the loaded params.
--
-- Offloaded optimizer state is large (12 bytes per parameter against 2 for bf16 params) and lives
-- in host memory; for fine-tuning runs that restart cheaply it is often not worth writing. This
-- policy writes only the low-precision params while any group is offloaded.
--
-- Built on offload_fraction.lua (ferry.policy): its place() is offload_fraction's, unchanged, and
-- this file overrides only checkpoint() and after_load().
--
-- Args:
--   fraction   as in offload_fraction.lua: the share of parameter elements offloaded, a number in
--              [0, 1], default 0.5.
--   numa       optional NUMA mode for the pinned arena, as in offload_fraction.lua.
--   always     "true": model-only checkpoints even when nothing is offloaded; default "false".
--   keep_last  checkpoints to keep, an integer >= 0 (0 keeps all); default 0.
--
-- place(): offload_fraction.lua's (a leading prefix of the groups in parameter order whose elements
--   fit in fraction * total; fraction > 0 offloads at least the first group; fraction < 1 keeps at
--   least the last group on the GPU when there are two or more).
--
-- checkpoint(): when info.offloaded is not empty (or always = "true"):
--   { skip = { "optimizer", "master" }, keep_last = keep_last }: a model-only checkpoint.
--   Otherwise { skip = {}, keep_last = keep_last }: everything is written.
--
-- after_load():
--   sync: the groups the load restored (event.groups) when the masters were not loaded, else none.
--   reset_optimizer: true when the optimizer state was not loaded, else false.
--   So resuming from one of this policy's model-only checkpoints starts Adam afresh from masters
--   equal to the loaded params, and a full checkpoint resumes exactly.

-- No args table: the base shares this policy's args (it sees fraction, from and numa, the ones it takes).
local base = ferry.policy("offload_fraction")

local M = { place = base.place }

local function parse_bool(args, name)
  local text = args[name]
  if text == nil or text == "false" then return false end
  if text == "true" then return true end
  error(string.format("args.%s must be \"true\" or \"false\", got %q", name, tostring(text)), 0)
end

local function parse_keep_last(args)
  local text = args.keep_last
  if text == nil then return 0 end
  local k = tonumber(text)
  if k == nil or k < 0 or k ~= math.floor(k) or k > 2^31 - 1 then
    error(string.format("args.keep_last must be an integer >= 0, got %q", tostring(text)), 0)
  end
  return k
end

function M.checkpoint(info, ctx)
  local keep_last = parse_keep_last(ctx.args)
  if #info.offloaded > 0 or parse_bool(ctx.args, "always") then
    return { skip = { "optimizer", "master" }, keep_last = keep_last }
  end
  return { skip = {}, keep_last = keep_last }
end

function M.after_load(event, ctx)
  local sync = "none"
  if not event.masters_loaded then sync = event.groups end
  return { sync = sync, reset_optimizer = not event.optimizer_loaded }
end

-- The base's args (fraction, from, numa) and this file's own.
M.args = base.args
M.args.always = "true: model-only checkpoints even when nothing is offloaded (default false)"
M.args.keep_last = "checkpoints to keep, an integer >= 0 (default 0: keep all)"

return M
