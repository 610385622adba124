"""Tokenize the client's prompt once, and use the ids everywhere they help.

The ids give placement an exact token count and the prompt's block-hash chain. For
completions they also go to the engines in place of the text ("tokenizer reuse", seed 000's
冗余计算问题): neither P nor D tokenizes the prompt again. That does not apply to chat
requests, whose chat template the engine renders itself, and which vLLM's chat endpoint
cannot take as token ids; for chat the ids serve placement only and the body is untouched.
"""

from __future__ import annotations

import logging

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dataplane.chat_template import TokenizeError
from dataplane.requests import ClientRequest
from dataplane.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class PromptProcessor:
    def __init__(self, tokenizer: Tokenizer | None, *, reuse_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.reuse_tokens = reuse_tokens

    async def process(self, req: ClientRequest) -> None:
        tok = self.tokenizer
        if tok is None:
            return
        try:
            if req.is_chat:
                req.token_ids = await tok.encode_chat_request_async(req.body)
                req.prompt_tokens = len(req.token_ids)
                return
            prompts = await tok.encode_completion_request_async(req.body)
        except TokenizeError as exc:
            # The engine decides what is valid; we just route this one without token ids.
            log.debug("routing without token ids: %s", exc)
            return
        req.prompt_tokens = sum(len(p) for p in prompts)
        req.token_ids = prompts[0] if len(prompts) == 1 else None
        if self.reuse_tokens and isinstance(req.body.get("prompt"), (str, list)) and _has_text(req.body["prompt"]):
            body = dict(req.body)
            body["prompt"] = prompts[0] if len(prompts) == 1 else prompts
            body.pop("add_special_tokens", None)   # already applied
            req.body = body
            if req.token_ids is None:
                req.raw = orjson.dumps(body)
            else:   # the ids serialized once, for the engine's body and the hashing process
                ids_json = orjson.dumps(req.token_ids)
                req.token_ids_json = (req.token_ids, ids_json)
                req.raw = orjson.dumps({**body, "prompt": orjson.Fragment(ids_json)})


def _has_text(prompt) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))


class PrefixReuseMetrics:
    """Scrape-time view of the tokenizer's prefix-id reuse (``dataplane.prefix_ids``): the
    hit rate is ``ids_reused / (ids_reused + ids_encoded)`` over long texts."""

    def __init__(self, prompts: PromptProcessor) -> None:
        self.prompts = prompts

    def describe(self):
        return []

    def collect(self):
        tok = self.prompts.tokenizer
        cache = tok.prefix_ids if tok is not None else None
        if cache is None:
            return
        st = cache.stats
        yield CounterMetricFamily("omni_dp_tokenizer_prefix_texts", "Long texts tokenized through the prefix-id "
                                  "cache", value=st.texts)
        yield CounterMetricFamily("omni_dp_tokenizer_prefix_hits", "Of those, texts that reused a cached prefix",
                                  value=st.hits)
        yield CounterMetricFamily("omni_dp_tokenizer_prefix_ids_reused", "Token ids taken from the cache",
                                  value=st.ids_reused)
        yield CounterMetricFamily("omni_dp_tokenizer_prefix_ids_encoded", "Token ids encoded (not in the cache)",
                                  value=st.ids_encoded)
        yield GaugeMetricFamily("omni_dp_tokenizer_prefix_ids_held", "Token ids the cache holds",
                                value=cache.ids_held)
