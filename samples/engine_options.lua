-- The engine's options from a script: ferry.engine{} takes every EngineOptions field a script can use, and
-- refuses a field it does not know or a value out of range, naming it.
--
--   ferry run samples/engine_options.lua
--
-- An engine with one CPU Adam worker, a 4 KiB pipeline chunk, a quarter of the spare state, the state
-- later at half the grads' bytes and a trace file, all offloaded; the stats show what it took. Then:
-- a misspelt field, a fraction out of range, a bad NUMA policy and half a local-rank pair are refused,
-- and Adam without bias correction moves a param by its closed form.
--
-- Any failure raises an error, so `ferry run` exits non-zero.
local ferry = require("ferry")

local N = 1024
local tmp = os.tmpname()
os.remove(tmp)
local trace = tmp .. ".trace.json"

local e = ferry.engine{
  policy = "scripts/policies/offload_all.lua",
  lr = 0.01,
  threads = 1,             -- CPU Adam's workers (EngineOptions::cpu_threads)
  chunk_bytes = 4096,      -- the offload pipeline's chunk (transfer_chunk_bytes)
  spare_state = 0.25,      -- the early steps' spare state (spare_state_fraction)
  state_later = "0.5",     -- the state later: half the offloaded fp32 grads' bytes ("off", "auto" or a fraction)
  trace_path = trace,      -- every step as a Chrome/Perfetto trace, written when the engine closes
}
local param, grad = ferry.tensor("f32", N), ferry.tensor("f32", N)
local init, g = {}, {}
for i = 1, N do init[i], g[i] = math.sin(i), math.cos(3 * i) end
param:upload(init)
grad:upload(g)
e:add_param{ name = "w", group = "w", shape = { N }, param = param, grad = grad }
e:finalize()
assert(e:placement()[1].device == "cpu", "offload_all put w on the GPU")
e:step()
local s = e:stats()
assert(s.step == 1 and s.cpu_threads == 1 and s.transfer_chunk_bytes == 4096,
       ("stats: step %d, %d workers, a chunk of %d bytes"):format(s.step, s.cpu_threads, s.transfer_chunk_bytes))
print(("one step: %d CPU Adam worker, chunks of %d bytes, local rank %d of %d, pinned budget %.1f GiB"):format(
  s.cpu_threads, s.transfer_chunk_bytes, s.local_rank, s.local_world_size, s.pinned_limit_bytes / 2 ^ 30))
e:close()
local f = assert(io.open(trace, "r"), "no trace at " .. trace)
f:close()
os.remove(trace)

-- Misuse: refused at once, naming the field.
local function refused(options, text)
  local ok, err = pcall(ferry.engine, options)
  assert(not ok and err:find(text, 1, true), ("expected an error with %q, got %s"):format(text, tostring(err)))
end
refused({ spare_sate = 0.5 }, "unknown field 'spare_sate'")
refused({ spare_state = 1.5 }, "EngineOptions::spare_state_fraction is 1.5")
refused({ state_later = "half" }, "EngineOptions::state_later is 'half'")
refused({ numa = "nearest" }, "unknown NUMA policy 'nearest'")
refused({ local_rank = 1 }, "EngineOptions::local_rank is 1 and local_world_size is -1")
refused({ threads = -1 }, "field 'threads' must be an integer in [0, ")
refused({ pin_cpu_threads = 2 }, "field 'pin_cpu_threads' must be an integer in [-1, 1]")

-- Without bias correction the first step moves a param by lr * (1 - beta1) g / (sqrt(1 - beta2) |g| + eps).
local lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
local plain = ferry.engine{ lr = lr, weight_decay = 0, bias_correction = false }
local p1, g1 = ferry.tensor("f32", 1), ferry.tensor("f32", 1)
p1:upload{ 1 }
g1:upload{ 0.37 }
plain:add_param{ name = "p", group = "p", shape = { 1 }, param = p1, grad = g1 }
plain:finalize()
plain:step()
local want = 1 - lr * (1 - b1) * 0.37 / (math.sqrt((1 - b2) * 0.37 ^ 2) + eps)
local got = p1:download()[1]
assert(math.abs(got - want) < 1e-6, ("without bias correction: %.9g, want %.9g"):format(got, want))
print("engine_options: OK")
