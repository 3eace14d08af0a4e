"""An agent for the end-to-end runs: two turns of chat through its session, the second after a
user's nudge, and the last answer as the response."""

from __future__ import annotations


async def two_turns(client, sample):
    messages = list(sample.messages)
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    messages += [first.choices[0].message, {"role": "user", "content": "sure?"}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    return second.choices[0].message.content
