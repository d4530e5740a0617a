-- A broken policy is reported and survived: the engine keeps training with the policy it had.
--
--   ferry run samples/policy_error.lua
--
-- An engine trains with offload_fraction.lua. Between steps the script tries to hot-reload a series
-- of broken policies (written to a temporary directory): a runtime error, a wrong result, a sandbox
-- escape, an endless loop, a syntax error. Each reload fails with a message naming the file, the
-- line and the hook, and leaves the old policy and placement in force. Then a policy whose place()
-- works but whose checkpoint() hook is wrong is loaded: the save fails, no checkpoint is written,
-- and training goes on. Throughout, the params stay bit-identical to a second engine that never saw
-- any of it. Any deviation raises an error, so `ferry run` exits non-zero.
local ferry = require("ferry")

local FEATURES, GROUPS, SAMPLES = 16, 2, 64
local policies = ferry.script_dir .. "/../scripts/policies/"
local tmp = os.tmpname()
os.remove(tmp)
local dir = tmp .. ".policies"
local made = os.execute("mkdir -p '" .. dir .. "'")
assert(made == 0 or made == true, "cannot create " .. dir)

local regression = dofile(ferry.script_dir .. "/lib/linear_regression.lua")
local problem = regression.new{ ferry = ferry, features = FEATURES, groups = GROUPS, samples = SAMPLES, seed = 5,
                                weight = function(j) return 1 / j end, intercept = 1.0 }

local function build()
  return problem:build({ policy = policies .. "offload_fraction.lua", args = { fraction = 0.5 }, lr = 0.02 }, 17)
end
local function forward_backward(model) return problem:forward_backward(model) end
local function snapshot(model) return problem:snapshot(model) end

local function placement(model)
  local cells = {}
  for _, p in ipairs(model.engine:placement()) do cells[#cells + 1] = p.group .. "=" .. p.device end
  return table.concat(cells, " ")
end

local function write(name, text)
  local path = dir .. "/" .. name
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
  return path
end

local engine_model, reference = build(), build()
local function step_both(n)
  for _ = 1, n do
    forward_backward(engine_model)
    engine_model.engine:step()
    forward_backward(reference)
    reference.engine:step()
  end
  if snapshot(engine_model) ~= snapshot(reference) then
    error("the params differ from the engine that never saw a broken policy")
  end
end

print(("ferry %s on %s"):format(ferry.version, ferry.device_name()))
local before = placement(engine_model)
print("placement: " .. before)
step_both(5)

-- Each broken policy, and what its error must say.
local broken = {
  { file = "runtime_error.lua", expect = { "runtime_error.lua:4:", "place()", "attempt to index",
                                           "stack traceback" },
    text = "local M = {}\nfunction M.place(groups, ctx)\n  local out = {}\n"
        .. "  out[groups[1].name] = ctx.args.missing.field\n  return out\nend\nreturn M\n" },
  { file = "wrong_result.lua",
    expect = { "wrong_result.lua: place(): group \"layer1\" has placement \"disk\"; expected "
               .. "\"cpu\" or \"gpu\"", "(hook defined at " },
    text = "return {\n  place = function(groups, ctx)\n"
        .. "    return { layer0 = 'cpu', layer1 = 'disk' }\n  end,\n}\n" },
  { file = "escape.lua", expect = { "escape.lua:2:", "'io' is not available in the policy sandbox" },
    text = "return { place = function(groups, ctx)\n  local f = io.open('/etc/passwd')\nend }\n" },
  { file = "endless.lua", expect = { "endless.lua:2:", "instruction limit exceeded" },
    text = "return { place = function(groups, ctx)\n  while true do end\nend }\n" },
  { file = "syntax.lua", expect = { "syntax.lua:3:", "'<name>' expected near '='" },
    text = "return {\n  place = function(groups, ctx)\n    local = 1\n  end,\n}\n" },
}
for _, b in ipairs(broken) do
  local path = write(b.file, b.text)
  local ok, err = pcall(engine_model.engine.reload_policy, engine_model.engine, { path = path })
  if ok then error("reloading " .. b.file .. " should have failed") end
  for _, part in ipairs(b.expect) do
    if not err:find(part, 1, true) then
      error(("the error of %s does not say %q:\n%s"):format(b.file, part, err))
    end
  end
  print(("reload %-18s refused: %s"):format(b.file, (err:gsub("\n.*", ""))))
  if placement(engine_model) ~= before then error("a failed reload changed the placement") end
  step_both(3)
end

-- place() works, checkpoint() does not: the reload succeeds, the save fails, nothing is written.
local half = write("bad_checkpoint.lua", [[
local M = {}
function M.place(groups, ctx)
  local out = {}
  for i, g in ipairs(groups) do out[g.name] = i == 1 and "cpu" or "gpu" end
  return out
end
function M.checkpoint(info, ctx)
  return { skip = { "optimiser" }, keep_last = 1 }  -- misspelt
end
return M
]])
engine_model.engine:reload_policy{ path = half }
local ckpt_root = dir .. "/ckpt"
local ok, err = pcall(engine_model.engine.save, engine_model.engine, ckpt_root, 100)
assert(not ok, "saving with a broken checkpoint() hook should fail")
assert(err:find("bad_checkpoint.lua: checkpoint(): field \"skip\" entry 1 is \"optimiser\"", 1, true), err)
assert(err:find("(hook defined at " .. half .. ":7)", 1, true), err)
print("save refused: " .. err:gsub("\n.*", ""))
local probe = io.open(ckpt_root .. "/step-00000100/manifest.json")
if probe then probe:close(); error("a failed save left a checkpoint behind") end
step_both(3)

-- A good policy again, and a last check.
engine_model.engine:reload_policy{ path = policies .. "offload_fraction.lua", args = { fraction = 0.5 } }
step_both(5)
local verified, why = engine_model.engine:verify_masters()
assert(verified, why)
print(("survived %d failed reloads and a failed save: %d steps, bit-identical to the engine that"
  .. " never saw them"):format(#broken, 5 + 3 * #broken + 3 + 5))
os.execute("rm -rf '" .. dir .. "'")
