"""A verifiers taskset written against ``verifiers.v1`` alone: sums to answer, two rewards over
the episode's trace (one weighted 0.5)."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        return 1.0 if len(trace.last_reply) < 10 else 0.0


class Sums(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a in range(1, 5):
            yield SumTask(
                SumData(
                    prompt=f"What is {a} + {a}?",
                    system_prompt="Answer with a number.",
                    answer=str(2 * a),
                )
            )


def load_taskset():
    return Sums(vf.TasksetConfig())
