"""`lmserve chat`: a terminal chat with an in-process engine, as `llamafactory-cli chat`.

The conversation follows LLaMA-Factory 0.9's `run_chat` (`chat/chat_model.py`): its welcome
line, a `User: ` prompt, a streamed `Assistant: ` answer, `clear` (forget the history) and
`exit`. Beyond it, as a terminal program is expected to behave:

- text typed while an answer streams is neither echoed into the answer nor run as the next
  input (the terminal's echo is off during the answer and what was typed is discarded after it);
- Ctrl-C during an answer stops that answer (the engine stops generating it) and returns to the
  prompt, keeping what was written so far in the history; Ctrl-C or Ctrl-D at the prompt, and
  `exit`, leave with a goodbye line and exit status 0;
- an error (e.g. a conversation longer than the context) is one line, and the chat goes on.

The engine runs on an asyncio event loop in a daemon thread; the main thread reads input with
`input()` (readline editing, history) and so receives Ctrl-C as `KeyboardInterrupt` wherever
it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
import uuid
from concurrent.futures import Future
from typing import Any, Iterator

from rich.console import Console

from engines.errors import ServingError

# LLaMA-Factory's own words (`run_chat`), kept for its users' scripts.
WELCOME = "Welcome to the CLI application, use `clear` to remove the history, use `exit` to exit the application."
CLEARED = "History has been removed."
HELP = "Commands: clear (forget the conversation), exit or Ctrl-D (quit), help. Ctrl-C stops an answer."
GOODBYE = "Bye."
STOPPED = "[stopped]"

_DONE = object()  # end of an answer's deltas


class EngineThread:
    """An asyncio event loop in a daemon thread that owns the engine.

    Coroutines are submitted with `submit` (a `concurrent.futures.Future`); `call` waits for
    one. The loop thread is a daemon so that a stuck engine cannot keep the process alive.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lmserve-chat-engine", daemon=True)
        self._thread.start()

    def submit(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@contextlib.contextmanager
def typing_suppressed(stream: Any = None) -> Iterator[None]:
    """While inside, keys typed on the terminal are not echoed; on leaving, what was typed is
    discarded (`tcflush`) and the terminal's settings are restored. Ctrl-C still interrupts
    (signals stay on). Does nothing when `stream` (default stdin) is not a terminal."""
    stream = stream or sys.stdin
    try:
        is_terminal = stream.isatty()
    except (OSError, ValueError, AttributeError):  # closed, or not a file
        is_terminal = False
    if not is_terminal:  # a pipe or a file: nothing is echoed
        yield
        return
    import termios

    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)  # lflag: no echo, no line editing; ISIG kept
    try:
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
        yield
    finally:
        termios.tcflush(fd, termios.TCIFLUSH)
        termios.tcsetattr(fd, termios.TCSANOW, saved)


class TerminalChat:
    """The chat loop over a started engine and its prompt renderer.

    Args:
        engine: an `engines.base.Engine`, started, owned by `engine_thread`'s loop.
        renderer: the model's `engines.prompt.renderer.PromptRenderer`.
        engine_thread: the loop the engine runs on.
        console: where to write (default: stdout through `rich`, plain text when it is not a
            terminal).
    """

    def __init__(self, engine: Any, renderer: Any, engine_thread: EngineThread, console: Console | None = None):
        self.engine = engine
        self.renderer = renderer
        self.engine_thread = engine_thread
        self.console = console or Console(highlight=False, soft_wrap=True, markup=False)
        self.messages: list[dict[str, str]] = []

    def run(self) -> int:
        """Chat until `exit`, Ctrl-D or Ctrl-C at the prompt; returns the exit status (0)."""
        self.console.print(WELCOME)
        self.console.print(HELP, style="dim")
        while True:
            try:
                query = input("\nUser: ")
            except (EOFError, KeyboardInterrupt):
                self.console.print()
                break
            command = query.strip()
            if command == "exit":
                break
            if command == "clear":
                self.messages = []
                self.console.print(CLEARED)
                continue
            if command in ("help", "?"):
                self.console.print(HELP, style="dim")
                continue
            if not command:
                continue
            self.answer(query)
        self.console.print(GOODBYE)
        return 0

    def answer(self, query: str) -> None:
        """Stream the model's answer to `query`; Ctrl-C stops it, keeping what was written so
        far in the history (a turn stopped before any text, or refused, is dropped)."""
        from engines.base import GenerationRequest, SamplingParams

        self.messages.append({"role": "user", "content": query})
        self.console.print("Assistant: ", style="bold", end="")
        deltas: queue.Queue = queue.Queue()
        text: list[str] = []
        job: Future | None = None
        try:
            with typing_suppressed():
                ids = self.renderer.render_chat(self.messages)
                params = self.renderer.with_stop_token_ids(SamplingParams())
                job = self.engine_thread.submit(self._generate(GenerationRequest(uuid.uuid4().hex, ids, params),
                                                               deltas))
                while (item := deltas.get()) is not _DONE:
                    text.append(item)
                    self.console.out(item, end="", highlight=False)
            job.result()  # the engine's error, if it failed
        except KeyboardInterrupt:
            if job is not None:
                job.cancel()  # cancels the generation task: the engine stops generating this answer
            self.console.print(f" {STOPPED}", style="dim", markup=False)
            if not text:
                self.messages.pop()
                return
        except Exception as exc:  # noqa: BLE001 - one line, and the chat goes on
            self._refused(exc)
            return
        else:
            self.console.print()
        self.messages.append({"role": "assistant", "content": "".join(text)})

    async def _generate(self, request: Any, deltas: queue.Queue) -> None:
        try:
            async for delta in self.engine.generate(request):
                if delta.text:
                    deltas.put(delta.text)
        finally:
            deltas.put(_DONE)

    def _refused(self, exc: Exception) -> None:
        self.messages.pop()  # the question that was not answered
        self.console.print()
        message = exc.message if isinstance(exc, ServingError) else f"{type(exc).__name__}: {exc}"
        self.console.print(f"error: {message}", style="red", markup=False)


def run_chat(config: Any) -> int:
    """Load `config`'s engine in process and chat in the terminal; returns the exit status.

    Raises:
        ModelLoadError: the model cannot be loaded.
    """
    from engines import create_engine
    from engines.prompt.renderer import PromptRenderer

    import time

    engine_thread = EngineThread()
    engine = create_engine(config)
    try:
        # Loading takes from seconds to minutes; LLaMA-Factory's chat is silent meanwhile.
        print(f"lmserve chat: loading {config.model_name_or_path!r} ({config.infer_backend}); Ctrl-C stops",
              file=sys.stderr, flush=True)
        started = time.monotonic()
        engine_thread.call(engine.start())
        print(f"lmserve chat: loaded in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        renderer = PromptRenderer.for_config(engine.model_path, config)
        return TerminalChat(engine, renderer, engine_thread).run()
    except KeyboardInterrupt:  # while loading
        print(file=sys.stderr)
        return 130
    finally:
        with contextlib.suppress(Exception):
            engine_thread.call(engine.shutdown(), timeout=60)
        engine_thread.stop()
