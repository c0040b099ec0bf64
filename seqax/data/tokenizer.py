"""Tokenizers: the ones tools/prepare_dataset.py encodes with, and a dataset's own, rebuilt from
what the dataset stores, for sample.py and tools/export_hf.py to decode and export.

Id 0 is the model's begin-of-document input (train.py builds inputs with 0 at document starts),
so no tokenizer here produces it:
  bytes       the UTF-8 bytes of the text: id = byte + 1 (1..256); 257 = end of document.
              No download, vocabulary 258.
  tokenizers  a Hugging Face `tokenizers` tokenizer.json (a local file, or a hub name when
              online): id = its id + 1. Its JSON is stored in the dataset (array `tokenizer_json`).
Each document may end with an end-of-document id (bytes: 257; tokenizers: a token named with
--eos-token), which decode() drops. The dataset attribute `tokenizer` records which of these
made the ids (`identity()`), so training and sampling can decode.
"""

import hashlib
import json
import os

import numpy as np
import zarr

from seqax.config import DatasetError, TokenizerError

ID_OFFSET = 1  # stored id = tokenizer id + 1; 0 is the begin-of-document input
EOD_TOKEN = "<eod>"  # the bytes tokenizer's end of document, in its tokenizer.json
MAX_ID = 2**31 - 1  # flat-tokens stores id * 2 + is_start in uint32


class ByteTokenizer:
    kind = "bytes"
    vocab_size = 258

    def __init__(self, eos: bool = True):
        self.eos_id = 257 if eos else None

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        tail = [] if self.eos_id is None else [self.eos_id]
        return [np.concatenate([np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.uint32) + ID_OFFSET,
                                np.array(tail, np.uint32)]) for t in texts]

    def text_ids(self, text: str) -> np.ndarray:
        """The ids of `text`, without an end of document."""
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint32) + ID_OFFSET

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[(ids >= ID_OFFSET) & (ids < 256 + ID_OFFSET)]
        return (ids - ID_OFFSET).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def identity(self) -> dict:
        return {"kind": self.kind, "bos_id": 0, "eos_id": self.eos_id, "id_offset": ID_OFFSET,
                "vocab_size": self.vocab_size}

    def tokenizer_json(self) -> str:
        """This tokenizer as a `tokenizers` tokenizer.json, with ids before the + 1 (byte b is id b,
        the end of document EOD_TOKEN 256), so that a tool reading tokenizer.json files (the
        export, which shifts the ids) treats it as any other: a byte-level BPE without merges, each
        byte one token, under GPT-2's printable stand-ins for bytes."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        others = [b for b in range(256) if b not in printable]
        stand_in = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
        tok = Tokenizer(models.BPE({stand_in[b]: b for b in range(256)}, []))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        if self.eos_id is not None:
            tok.add_special_tokens([EOD_TOKEN])
        return tok.to_str()

    def spec(self) -> tuple:
        """What a worker process needs to rebuild this tokenizer."""
        return ("bytes", self.eos_id is not None)


class JsonTokenizer:
    kind = "tokenizers"

    def __init__(self, json_text: str, source: str, eos_token: str | None = None):
        from tokenizers import Tokenizer

        self.json_text, self.source = json_text, source
        self.tokenizer = Tokenizer.from_str(json_text)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise TokenizerError(f"tokenizer {source!r} has an empty vocabulary")
        largest = max(vocab.values())
        if largest + ID_OFFSET > MAX_ID:
            raise TokenizerError(f"tokenizer {source!r} has token id {largest}; "
                                 f"flat-tokens needs id + {ID_OFFSET} below 2^31 (at most {MAX_ID - ID_OFFSET})")
        self.vocab_size = largest + 1 + ID_OFFSET
        self.eos_token, self.eos_id = eos_token, None
        if eos_token is not None:
            if eos_token not in vocab:
                raise TokenizerError(f"--eos-token {eos_token!r} is not in the vocabulary of tokenizer {source!r}")
            self.eos_id = vocab[eos_token] + ID_OFFSET

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        tail = np.array([] if self.eos_id is None else [self.eos_id], np.uint32)
        return [np.concatenate([np.array(e.ids, np.uint32) + np.uint32(ID_OFFSET), tail])
                for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def text_ids(self, text: str) -> np.ndarray:
        """The ids of `text`, without an end of document."""
        return np.array(self.tokenizer.encode(text, add_special_tokens=False).ids, np.uint32) + np.uint32(ID_OFFSET)

    def decode(self, ids) -> str:
        ids = [int(i) - ID_OFFSET for i in np.asarray(ids).ravel() if int(i) >= ID_OFFSET and int(i) != self.eos_id]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def identity(self) -> dict:
        return {"kind": self.kind, "source": self.source, "sha256": hashlib.sha256(self.json_text.encode()).hexdigest(),
                "stored_as": "tokenizer_json", "bos_id": 0, "eos_id": self.eos_id, "eos_token": self.eos_token,
                "id_offset": ID_OFFSET, "vocab_size": self.vocab_size}

    def spec(self) -> tuple:
        return ("tokenizers", self.json_text, self.source, self.eos_token)


def from_spec(spec: tuple):
    return ByteTokenizer(spec[1]) if spec[0] == "bytes" else JsonTokenizer(*spec[1:])


def load_tokenizer(name: str, eos: bool = True, eos_token: str | None = None):
    """`bytes`, a tokenizer.json path, or a hub name (needs the network)."""
    if name == "bytes":
        if eos_token is not None:
            raise TokenizerError("--eos-token is for a tokenizer.json; "
                                 "the bytes tokenizer's end of document is id 257 (turn it off with --no-eos)")
        return ByteTokenizer(eos)
    if os.path.exists(name):
        try:
            with open(name, "rb") as f:
                data = f.read()
        except OSError as e:
            raise TokenizerError(f"cannot read tokenizer file {name!r}: {e.strerror or e}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"tokenizer file {name!r} is not UTF-8 text (its byte {e.start} from the start is "
                                 f"0x{data[e.start]:02x}); a tokenizer.json is UTF-8 JSON") from None
        try:
            json.loads(text)
        except ValueError as e:
            raise TokenizerError(f"tokenizer file {name!r} is not JSON: {e}") from None
    else:
        from tokenizers import Tokenizer

        try:
            text = Tokenizer.from_pretrained(name).to_str()
        except Exception as e:  # the hub client raises many kinds
            raise TokenizerError(f"tokenizer {name!r} is not a file and could not be fetched "
                                 f"from the hub: {e}") from None
    try:
        return JsonTokenizer(text, name, eos_token if eos else None)
    except TokenizerError:
        raise
    except Exception as e:  # tokenizers raises a plain Exception for a malformed file
        raise TokenizerError(f"tokenizer {name!r} could not be loaded: {e}") from None


def dataset_tokenizer(path: str):
    """The tokenizer that wrote the flat-tokens dataset at `path`, for decoding."""
    if not os.path.isdir(path):
        raise DatasetError(f"dataset {path!r} (for its tokenizer) does not exist; "
                           "pass --dataset PATH of the run's flat-tokens dataset")
    group = zarr.open_group(path, mode="r")
    info = dict(group.attrs).get("tokenizer", {})
    if info.get("kind") == "bytes":
        return ByteTokenizer(info.get("eos_id") is not None)
    if info.get("kind") == "tokenizers":
        text = group[info["stored_as"]][:].tobytes().decode("utf-8")
        return JsonTokenizer(text, info["source"], info.get("eos_token"))
    raise TokenizerError(f"dataset {path!r} was not written by a text tokenizer (its tokenizer attribute is {info!r})")
