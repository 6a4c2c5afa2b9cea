"""The ingress's grammar compiler (docs/api.md#structured-output): a request's constraint checked by
llguidance against the served tokenizer off the event loop, within a time bound, and cached by its value, so
a schema sent again costs a dict lookup. The shards compile the same grammar text again for their matchers
(model/grammar/guide.py), which is why a grammar that fails here never reaches them."""
from __future__ import annotations

import asyncio
from collections import OrderedDict

from model.checkpoint import Checkpoint
from model.grammar.compile import GrammarRequest, check_grammar
from model.grammar.tokenizer import grammar_tokenizer
from model.sampling.params import Grammar, ParamError

# a grammar's check runs in a thread; one that takes longer is a 400 (llguidance's limits bound its work, so
# the thread ends soon after)
COMPILE_TIMEOUT_S = 10.0
CACHED_GRAMMARS = 256


class GrammarCompiler:
    def __init__(self, checkpoint: Checkpoint, timeout_s: float = COMPILE_TIMEOUT_S):
        self.checkpoint, self.timeout_s = checkpoint, timeout_s
        self._tokenizer = None
        self._lock = asyncio.Lock()
        self._cache: OrderedDict[str, Grammar | ParamError] = OrderedDict()

    async def compile(self, req: GrammarRequest) -> Grammar:
        """The engine's Grammar for `req`; ParamError naming the request's field when it is invalid,
        unsupported, too large or too slow to compile."""
        key = req.key()
        if key not in self._cache:
            tokenizer = await self._load_tokenizer()
            try:
                text = await asyncio.wait_for(asyncio.to_thread(check_grammar, req, tokenizer), self.timeout_s)
                result: Grammar | ParamError = Grammar(text=text, field=req.field)
            except ParamError as err:
                result = err
            except asyncio.TimeoutError:   # not cached: a less busy server may compile it in time
                raise ParamError(f"{req.field}: compiling it took over {self.timeout_s:g} s", req.field) from None
            self._cache[key] = result
            if len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        result = self._cache[key]
        if isinstance(result, ParamError):
            raise ParamError(result.message, result.param)
        return result

    async def _load_tokenizer(self):
        async with self._lock:   # built once, on the first constrained request (about a second for 100k+ tokens)
            if self._tokenizer is None:
                cfg = self.checkpoint.config
                self._tokenizer = await asyncio.to_thread(grammar_tokenizer, self.checkpoint.path, cfg.vocab_size,
                                                          cfg.eos_token_ids)
        return self._tokenizer
