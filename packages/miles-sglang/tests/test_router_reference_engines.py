"""The real sglang-router in front of two reference engines: requests through it succeed and are
spread over both engines."""

from __future__ import annotations

import concurrent.futures

import httpx

from miles.backends.sglang_utils.router import running_router


def _finished(url: str) -> int:
    return httpx.get(f"{url}/get_server_info", timeout=10).json()["internal_states"][0][
        "finished_requests"
    ]


def test_router_spreads_generate_requests_over_two_reference_engines(start_engine, tiny_checkpoint):
    with start_engine(tiny_checkpoint) as first, start_engine(tiny_checkpoint) as second:
        before = [_finished(first), _finished(second)]
        with running_router([first, second], policy="round_robin") as router:
            body = {
                "input_ids": [1, 2, 3],
                "sampling_params": {"temperature": 0, "max_new_tokens": 4, "sampling_seed": 7},
                "return_logprob": True,
            }

            def send(_):
                response = httpx.post(f"{router.url}/generate", json=body, timeout=60)
                assert response.status_code == 200, response.text
                return response.json()

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                results = list(pool.map(send, range(12)))
        assert all(r["output_ids"] == results[0]["output_ids"] for r in results)
        assert all(len(r["meta_info"]["output_token_logprobs"]) == 4 for r in results)
        served = [_finished(first) - before[0], _finished(second) - before[1]]
        assert sum(served) >= 12 and min(served) >= 3, f"requests per engine: {served}"
