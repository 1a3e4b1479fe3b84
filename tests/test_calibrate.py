"""colora tasks calibrate: the three numbers it prints, computed over a scripted engine."""

from __future__ import annotations

from colora.tasks import get_task

from colora.engine.rollout import GenResult
from colora.studies.calibrate import calibrate


class ScriptedEngine:
    """Greedy answers right on even items; sampled answers right on the first sample of item 0 only."""

    def __init__(self, items):
        self.items = items

    def generate(self, reqs):
        out = []
        for r in reqs:
            i = r.tag
            if r.temperature == 0:
                right = i % 2 == 0
            else:
                right = i == 0 and r.seed == reqs[0].seed
            text = f"<answer>{self.items[i].answer if right else 'nope'}</answer>"
            out.append(GenResult(r, -1, [1], [], text, "stop"))
        return out


class Tok:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return messages[-1]["content"]

    def __call__(self, text, add_special_tokens):
        class E:
            input_ids = [1, 2, 3]
        return E()


def test_calibrate_counts_greedy_sampled_and_mixed():
    from colora.seeding import derive_seed

    task = get_task("addition", digits=2)
    items = task.sample(8, derive_seed(0, "calibrate", "eval"), "eval")
    r = calibrate(ScriptedEngine(items), Tok(), task, n=8, samples=4, temperature=1.0, max_tokens=16)
    assert r["greedy_accuracy"] == 0.5
    assert r["sampled_reward"] == 1 / 32
    assert r["mixed_share"] == 1 / 8
