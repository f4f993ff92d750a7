"""Running a list of (request id, prompt, SamplingParams kwargs) to completion: on a job's front rank
(multi-rank tests) and in one process (what they must equal)."""
from __future__ import annotations


def run_on_front(eng, reqs: list[tuple[str, list[int], dict]], ranks: dict | None = None) -> dict:
    """eng: the front rank's Engine. -> {request id: its final CompletionOutput}; ranks, when given,
    gets each request's DP rank as the front chose it."""
    from wideep.engine import SamplingParams
    for rid, prompt, kw in reqs:
        eng.add_request(rid, prompt, SamplingParams(**kw))
        if ranks is not None:
            ranks[rid] = eng.front.rank_of(rid)
    got = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0]
    return got


def run_in_one_process(model_dir: str, reqs: list[tuple[str, list[int], dict]], **engine_kw) -> dict:
    """-> {request id: its CompletionOutput} from LLM.generate in this process."""
    from wideep.engine import LLM, SamplingParams
    outs = LLM(model_dir, progress=False, **engine_kw).generate([p for _, p, _ in reqs],
                                                               [SamplingParams(**kw) for _, _, kw in reqs])
    return {rid: o.outputs[0] for (rid, _, _), o in zip(reqs, outs)}
