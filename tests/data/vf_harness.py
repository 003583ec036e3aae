"""A verifiers harness written against ``verifiers.v1`` alone (harness id ``vf_harness``): it
asks the model, then asks again with a user message ("Sure?"), through the OpenAI client
verifiers hands it (its interception endpoint), in process."""

import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult


class AskTwiceConfig(vf.HarnessConfig):
    pass


class AskTwice(vf.Harness[AskTwiceConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
    ):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        # closed when done, as a harness should (grpo's loop copes with one left to the
        # garbage collector too: grpo.environments.event_loop)
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for _ in range(2):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                messages.append({"role": "user", "content": "Sure? Say it again."})
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["AskTwice"]
