"""A tiny fake OpenAI/SGLang-compatible server for the client tools' tests (aiohttp, loopback, own thread).

It tokenizes with a real byte-level BPE tokenizer (`make_tokenizer`), streams like the real
servers (`/generate` with cumulative text and meta_info, `/v1/completions` and
`/v1/chat/completions` as OpenAI SSE with a usage chunk), honours max tokens, ignore_eos
(without it a request stops after 3 tokens), stop strings and bearer keys, and records what it
saw — token counts of every prompt, peak requests in flight, profile calls — so tests check the
tools' counts against the server's. `fail_every=k` answers every k-th generation with HTTP 500.
"""

import asyncio
import json
import threading

from aiohttp import web

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Serving engines batch requests continuously; the KV cache is paged. Über naïve café — 東京 ✓",
]


def make_tokenizer(directory: str) -> str:
    """A 300-token byte-level BPE tokenizer saved in HF layout under `directory`; returns the path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(directory)
    return directory


class FakeServer:
    def __init__(self, tokenizer_dir: str, token_delay_s: float = 0.001, fail_every: int = 0,
                 answers: dict[str, str] | None = None, api_key: str | None = None, batch_generate: bool = False):
        from transformers import AutoTokenizer

        self.tokenizer_dir = tokenizer_dir
        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        # Outputs are drawn from plain lowercase-letter tokens so their text is clean.
        self.out_ids = [i for i in range(len(self.tok)) if self.tok.decode([i]).isalpha() and self.tok.decode([i]).islower()]
        self.token_delay_s = token_delay_s
        self.fail_every = fail_every
        self.answers = answers or {}
        self.api_key = api_key
        self.batch_generate = batch_generate
        self.prompt_tokens: list[int] = []        # per generation request, as this server tokenized it
        self.payloads: list[dict] = []
        self.profile_calls: list[str] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self._count = 0
        self.port = None

    # -- generation --------------------------------------------------------
    def _tokens(self, prompt_ids: list[int], n: int) -> list[int]:
        seed = sum(prompt_ids) + len(prompt_ids)
        return [self.out_ids[(seed + 7 * i) % len(self.out_ids)] for i in range(n)]

    def _plan(self, prompt_ids: list[int], prompt_text: str, max_tokens: int, ignore_eos: bool, stop) -> tuple[list[str], str]:
        """Per-token text pieces and the finish reason."""
        question = prompt_text.rsplit("Question: ", 1)[-1].split("\nAnswer:")[0] if "Question: " in prompt_text else None
        if question in self.answers:
            text = self.answers[question] + "\n\nQuestion: what next?"
            pieces = [self.tok.decode([t]) for t in self.tok.encode(text, add_special_tokens=False)]
        else:
            n = max_tokens if ignore_eos else min(max_tokens, 3)
            pieces = [self.tok.decode([t]) for t in self._tokens(prompt_ids, n)]
        pieces, reason = pieces[:max_tokens], "length"
        stops = [stop] if isinstance(stop, str) else (stop or [])
        text = "".join(pieces)
        cut = min([text.find(s) for s in stops if s in text], default=-1)
        if cut >= 0:
            kept, total = [], 0
            for p in pieces:
                if total + len(p) > cut:
                    if cut > total:
                        kept.append(p[: cut - total])
                    break
                kept.append(p)
                total += len(p)
            pieces, reason = kept, "stop"
        elif len(pieces) < max_tokens:
            reason = "stop"
        return pieces, reason

    def _admit(self, request: web.Request) -> web.Response | None:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad key", "type": "auth", "param": None, "code": 401}},
                                     status=401)
        self._count += 1
        if self.fail_every and self._count % self.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure", "type": "server_error",
                                                "param": None, "code": 500}}, status=500)
        return None

    async def _sse(self, request, chunks):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async for chunk in chunks:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _run(self, request, prompt_ids, prompt_text, max_tokens, ignore_eos, stop, stream, make_chunk, make_final, make_whole):
        self.prompt_tokens.append(len(prompt_ids))
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            pieces, reason = self._plan(prompt_ids, prompt_text, max_tokens, ignore_eos, stop)
            if not stream:
                await asyncio.sleep(self.token_delay_s * len(pieces))
                return web.json_response(make_whole("".join(pieces), len(pieces), reason))

            async def chunks():
                for i, piece in enumerate(pieces):
                    await asyncio.sleep(self.token_delay_s)
                    yield make_chunk(piece, i + 1, pieces, reason if i + 1 == len(pieces) else None)
                final = make_final(len(pieces), reason)
                if final is not None:
                    yield final
            return await self._sse(request, chunks())
        finally:
            self.in_flight -= 1

    async def generate(self, request: web.Request):
        body = await request.json()
        self.payloads.append(body)
        if (denied := self._admit(request)) is not None:
            return denied
        sp = body.get("sampling_params", {})
        ids = body.get("input_ids")
        if ids is not None and ids and isinstance(ids[0], list):
            raise web.HTTPBadRequest(text="batched input_ids are not supported here")
        text = body.get("text")
        prompt_ids = ids if ids is not None else self.tok.encode(text, add_special_tokens=False)
        prompt_text = text if text is not None else self.tok.decode(ids)
        n_prompt = len(prompt_ids)

        def meta(n, reason):
            return {"prompt_tokens": n_prompt, "completion_tokens": n, "cached_tokens": 0,
                    "finish_reason": {"type": reason} if reason else None, "e2e_latency": 0.01}

        return await self._run(
            request, prompt_ids, prompt_text, sp.get("max_new_tokens", 16), sp.get("ignore_eos", False),
            sp.get("stop"), body.get("stream", False),
            make_chunk=lambda piece, n, pieces, reason: {"text": "".join(pieces[:n]), "meta_info": meta(n, reason)},
            make_final=lambda n, reason: None,
            make_whole=lambda text, n, reason: {"text": text, "output_ids": [], "meta_info": meta(n, reason)})

    async def completions(self, request: web.Request, chat: bool = False):
        body = await request.json()
        self.payloads.append(body)
        if (denied := self._admit(request)) is not None:
            return denied
        if chat:
            prompt_text = body["messages"][-1]["content"]
            prompt_ids = self.tok.encode(prompt_text, add_special_tokens=False)
            n_prompt = len(prompt_ids) + 3       # a pretend chat template
        else:
            prompt = body["prompt"]
            prompt_ids = prompt if isinstance(prompt, list) else self.tok.encode(prompt, add_special_tokens=False)
            prompt_text = prompt if isinstance(prompt, str) else self.tok.decode(prompt)
            n_prompt = len(prompt_ids)
        include_usage = (body.get("stream_options") or {}).get("include_usage", False)
        obj = "chat.completion" if chat else "text_completion"

        def usage(n):
            return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

        def chunk(piece, n, pieces, reason):
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            return {"object": obj + ".chunk", "choices": [{**choice, "finish_reason": reason}]}

        def whole(text, n, reason):
            choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            return {"object": obj, "choices": [{"index": 0, **choice, "finish_reason": reason}], "usage": usage(n)}

        return await self._run(
            request, prompt_ids, prompt_text, body.get("max_tokens", 16), body.get("ignore_eos", False),
            body.get("stop"), body.get("stream", False), make_chunk=chunk,
            make_final=lambda n, reason: {"object": obj + ".chunk", "choices": [], "usage": usage(n)} if include_usage else None,
            make_whole=whole)

    async def chat(self, request: web.Request):
        return await self.completions(request, chat=True)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model", "root": self.tokenizer_dir}]})

    async def model_info(self, request):
        return web.json_response({"model_path": self.tokenizer_dir, "tokenizer_path": self.tokenizer_dir})

    async def profile(self, request):
        self.profile_calls.append(request.path)
        return web.json_response({"message": f"{request.path} ok"})

    # -- life cycle --------------------------------------------------------
    def start(self) -> "FakeServer":
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_post("/start_profile", self.profile)
        app.router.add_post("/stop_profile", self.profile)
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve():
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()

        def run():
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
