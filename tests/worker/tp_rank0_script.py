"""Rank 0 of a two-rank group whose other rank runs elsewhere (the two-namespace test):
``python tests/worker/tp_rank0_script.py config.yaml prompts.json`` prints each
prompt's greedy tokens as JSON, then stops the other rank."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config.loader import load_config  # noqa: E402
from engine_core.sampling_params import SamplingParams  # noqa: E402
from worker.bootstrap import in_process_engine  # noqa: E402
from worker.distributed.tp_group import destroy_tp_group  # noqa: E402


def main(config_path: str, prompts_path: str) -> None:
    prompts = json.loads(Path(prompts_path).read_text())
    loaded, engine = in_process_engine(load_config(config_path))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    loaded.runner.stop_followers()
    destroy_tp_group()
    print(json.dumps([tokens[f"r{i}"] for i in range(len(prompts))]))


if __name__ == "__main__":
    main(*sys.argv[1:])
