import os, sys, time
from tests.parallel.spawn import spawn

def rank_fn(d):
    import faulthandler, sys
    faulthandler.dump_traceback_later(80, exit=True, file=sys.stderr)
    from disagg import make_engine
    from engine import SamplingParams
    eng = make_engine(d, {"prefill": {"dp_size": 2, "ep_size": 2}, "decode": {"dp_size": 2, "ep_size": 2}},
                      progress=False, block_size=16, parallel={"timeout_s": 30})
    if not eng.is_front:
        return eng.run_worker_loop()
    for i in range(6):
        eng.add_request(f"r{i}", list(range(2, 20 + 7 * i)), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    done = {}
    import time; t0 = time.time(); last = 0
    print("front start", flush=True)
    while eng.has_unfinished_requests():
        if time.time() - last > 2:
            last = time.time(); print(round(last - t0, 1), {k: (v.accepted, v.header is not None, v.chunk, len(v.layers), v.trailer is not None) for k, v in eng.receiver.pending.items()}, file=sys.stderr, flush=True)
        for o in eng.step():
            if o.finished: done[o.request_id] = o.outputs[0].token_ids
    m = eng.metrics()
    eng.shutdown()
    return done, m["kv_transfer"], m["finished_requests"][0]

if __name__ == "__main__":
    from launch.tiny import make_tiny_checkpoint
    d = make_tiny_checkpoint("/tmp/g8/tiny", arch="v3", seed=5, initializer_range=0.3) if not os.path.exists("/tmp/g8/tiny/config.json") else "/tmp/g8/tiny"
    t = time.time()
    from tests.disagg._smoke_tmp import rank_fn as rf
    res = spawn(rf, 4, args=(d,), timeout_s=100)
    print(res[0]); print(res[1:], time.time() - t)
    from engine import LLM, SamplingParams
    llm = LLM(d, progress=False, block_size=16)
    for i in range(6):
        print(llm.generate([list(range(2, 20 + 7 * i))], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids)
