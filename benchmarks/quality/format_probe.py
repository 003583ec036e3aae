"""How often SmolLM2-135M-Instruct writes the <answer> tag, and answers right, before any training,
under candidate prompts for the default recipe (issue 14, point 7). 24 "a + b" problems (1-30),
48 new tokens (the recipe's limit); greedy, and 4 samples at temperature 1. Prints and writes to
benchmarks/results/format_probe.json the (tagged, exactly one tagged answer, correct) shares per
variant. Run: .venv/bin/python -m benchmarks.quality.format_probe [variant ...]
"""

import json
import random
import re
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.models import resolve_model_path


def main() -> None:
    torch.set_num_threads(2)

    p = resolve_model_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(p)
    tok.padding_side = "left"
    m = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
    random.seed(7)
    probs = [(random.randint(1, 30), random.randint(1, 30)) for _ in range(24)]
    BASE = "Solve the arithmetic problem. Write the final answer as a number inside <answer></answer> tags."
    EX = BASE + " Example: What is 2 + 3? <answer>5</answer>"
    # earlier chat turns (data.few_shot): bare or worked answers, one or two of them
    one = [("What is 2 + 3?", "<answer>5</answer>")]
    bare = [("What is 7 + 15?", "<answer>22</answer>"), ("What is 21 + 9?", "<answer>30</answer>")]
    worked = [
        ("What is 7 + 15?", "7 + 15 = 22\n<answer>22</answer>"),
        ("What is 21 + 9?", "21 + 9 = 30\n<answer>30</answer>"),
    ]
    variants = {
        "plain": (BASE, "", []),
        "prefix": (BASE, "<answer>", []),
        "prefix+example": (EX, "<answer>", []),
        "example": (EX, "", []),
        "prefix+shot": (BASE, "<answer>", one),
        "shot": (BASE, "", one),
        "two-shots": (BASE, "", bare),
        "two-worked-shots": (BASE, "", worked),
        "one-worked-shot": (BASE, "", worked[:1]),  # the default recipe's few_shot
    }
    only = sys.argv[1:] or list(variants)
    # variants measured earlier stay in the JSON, each with its own command and time
    out = Path("benchmarks/results/format_probe.json")
    report = json.loads(out.read_text()) if out.exists() else {}
    report["columns"] = ["tagged share", "exactly <answer>...</answer> share", "correct share"]
    run = {
        "command": " ".join(["python -m benchmarks.quality.format_probe", *sys.argv[1:]]),
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for name in only:
        system, prefix, shots = variants[name]
        prompts = []
        for a, b in probs:
            msgs = [{"role": "system", "content": system}]
            for question, answer in shots:
                msgs += [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ]
            msgs.append({"role": "user", "content": f"What is {a} + {b}?"})
            prompts.append(
                tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + prefix
            )
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        res = {}
        for mode, kw in (
            ("greedy", dict(do_sample=False)),
            (
                "sampled",
                dict(
                    do_sample=True, temperature=1.0, top_k=None, top_p=1.0, num_return_sequences=4
                ),
            ),
        ):
            torch.manual_seed(0)
            with torch.no_grad():
                out = m.generate(**enc, max_new_tokens=48, pad_token_id=tok.pad_token_id, **kw)
            texts = [
                prefix + t
                for t in tok.batch_decode(
                    out[:, enc.input_ids.shape[1] :], skip_special_tokens=True
                )
            ]
            k = len(texts) // len(probs)
            tagged = sum(bool(re.search(r"<answer>.*?</answer>", t, re.S)) for t in texts)
            exact = sum(bool(re.fullmatch(r"\s*<answer>.*?</answer>\s*", t, re.S)) for t in texts)
            corr = 0
            for i, t in enumerate(texts):
                a, b = probs[i // k]
                mm = re.findall(r"<answer>(.*?)</answer>", t, re.S)
                nums = re.findall(r"-?\d+", mm[-1] if mm else t)
                corr += bool(nums) and nums[-1] == str(a + b)
            res[mode] = (tagged / len(texts), exact / len(texts), corr / len(texts))
            ex = texts[:3]
        print(
            name,
            {k: tuple(round(x, 2) for x in v) for k, v in res.items()},
            [t[:60] for t in ex],
            flush=True,
        )
        report[name] = {**run, **{k: [round(x, 4) for x in v] for k, v in res.items()}}
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
