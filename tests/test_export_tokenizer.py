"""The exported tokenizer.json encodes to the original tokenizer's ids + 1 and decodes to the same
text, whichever post-processor adds its special tokens: one tokenizer of each kind the
tokenizers library has, trained here on a few sentences (no hub access)."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from seqax.config import TokenizerError
from seqax.data.tokenizer import ByteTokenizer
from tools.export_hf import BOS_TOKEN, PAD_TOKEN, exported_tokenizer_json, pad_id, shifted_tokenizer_json

SENTENCES = ["the quick brown fox jumps over the lazy dog", "hello world, the dog sleeps",
             "a fox and a dog meet at noon"]
SPECIALS = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "<s>", "</s>", "<|begin_of_text|>"]
TEXTS = [("the lazy fox", None), ("hello dog", "the quick world")]  # single and pair inputs


def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def word_piece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(SENTENCES, trainers.WordPieceTrainer(vocab_size=200, special_tokens=SPECIALS))
    return tok


def word_level() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    return tok


def with_post_processor(tok: Tokenizer, make) -> Tokenizer:
    tok.post_processor = make(lambda name: tok.token_to_id(name))
    return tok


# (name, base tokenizer, post-processor from a name -> id function). Ids of special tokens are
# never 0 here except [UNK]: a shift that is missed shows as a wrong id, not as a coincidence.
KINDS = [
    ("template", word_level, lambda i: processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", i("[CLS]")), ("[SEP]", i("[SEP]"))])),
    ("bert", word_piece, lambda i: processors.BertProcessing(("[SEP]", i("[SEP]")), ("[CLS]", i("[CLS]")))),
    ("roberta", byte_level_bpe, lambda i: processors.RobertaProcessing(("</s>", i("</s>")), ("<s>", i("<s>")))),
    ("byte_level", byte_level_bpe, lambda i: processors.ByteLevel(trim_offsets=True)),
    # Llama 3: ByteLevel offsets, then a template that puts <|begin_of_text|> first.
    ("sequence", byte_level_bpe, lambda i: processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", i("<|begin_of_text|>"))])])),
    ("none", word_level, lambda i: None),
]


@pytest.mark.parametrize("name,base,post_processor", KINDS, ids=[k[0] for k in KINDS])
def test_shifted_tokenizer_encodes_to_original_ids_plus_one_and_decodes_alike(name, base, post_processor):
    original = with_post_processor(base(), post_processor)
    shifted = Tokenizer.from_str(json.dumps(shifted_tokenizer_json(original.to_str())))
    assert shifted.token_to_id(BOS_TOKEN) == 0
    for text, pair in TEXTS:
        want = original.encode(text, pair)
        got = shifted.encode(text, pair)
        if name not in ("none", "byte_level"):
            assert len(want.ids) > len(original.encode(text, pair, add_special_tokens=False).ids), (
                "the post-processor adds special tokens")
        assert got.ids == [i + 1 for i in want.ids]
        assert got.tokens == want.tokens and got.type_ids == want.type_ids
        assert shifted.encode(text, pair, add_special_tokens=False).ids == [
            i + 1 for i in original.encode(text, pair, add_special_tokens=False).ids]
        for skip in (False, True):
            assert (shifted.decode(got.ids, skip_special_tokens=skip)
                    == original.decode(want.ids, skip_special_tokens=skip))


def test_padding_id_is_shifted():
    original = word_level()
    original.enable_padding(pad_id=original.token_to_id("[PAD]"), pad_token="[PAD]")
    shifted = Tokenizer.from_str(json.dumps(shifted_tokenizer_json(original.to_str())))
    want = [e.ids for e in original.encode_batch(["the dog", "the quick brown fox"])]
    assert ([e.ids for e in shifted.encode_batch(["the dog", "the quick brown fox"])]
            == [[i + 1 for i in ids] for ids in want])


def test_a_post_processor_it_cannot_shift_is_refused_in_one_line():
    tok = json.loads(word_level().to_str())
    tok["post_processor"] = {"type": "Sequence",
                             "processors": [{"type": "ByteLevel"}, {"type": "FancyProcessing", "ids": [3]}]}
    with pytest.raises(TokenizerError, match="FancyProcessing") as error:
        shifted_tokenizer_json(json.dumps(tok))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name,base,post_processor", KINDS, ids=[k[0] for k in KINDS])
def test_exported_tokenizer_adds_begin_of_document_and_nothing_else(name, base, post_processor):
    """The export's tokenizer.json: encoding with special tokens gives 0 and then the ids a
    dataset document of the text has (encoded without special tokens, every id + 1), with the
    original's offsets; the pad token sits at the first id above the data's."""
    original = with_post_processor(base(), post_processor)
    data_vocab = original.get_vocab_size() + 1
    exported = Tokenizer.from_str(json.dumps(exported_tokenizer_json(original.to_str(), data_vocab, data_vocab)))
    for text, _ in TEXTS:
        plain = original.encode(text, add_special_tokens=False)
        got = exported.encode(text)
        assert got.ids == [0, *(i + 1 for i in plain.ids)]
        assert got.tokens[1:] == plain.tokens and got.offsets[1:] == plain.offsets
        assert (exported.decode(got.ids, skip_special_tokens=True)
                == original.decode(plain.ids, skip_special_tokens=True))
    assert exported.token_to_id(PAD_TOKEN) == data_vocab


def test_pad_id_is_a_spare_row_else_end_of_document_and_never_zero():
    assert pad_id(data_vocab=181, model_vocab=192, eos_id=3) == 181
    assert pad_id(data_vocab=192, model_vocab=192, eos_id=3) == 3
    assert pad_id(data_vocab=192, model_vocab=192, eos_id=None) is None


def test_a_bytes_dataset_exports_a_tokenizer_of_its_own_ids():
    """The bytes tokenizer as a tokenizer.json, shifted like any other: [0] + each UTF-8 byte + 1,
    decoding back to the text, with <eod> at 257 (the dataset's end of document) and the pad above."""
    exported = Tokenizer.from_str(json.dumps(exported_tokenizer_json(ByteTokenizer(eos=True).tokenizer_json(),
                                                                     pad=258, data_vocab=258)))
    for text in ["def f(x):\n    return x  # é 你好", " leading", "\x00\x7f\t"]:
        ids = exported.encode(text).ids
        assert ids == [0, *(b + 1 for b in text.encode())], text
        assert exported.decode(ids, skip_special_tokens=True) == text
    special = (exported.token_to_id(BOS_TOKEN), exported.token_to_id("<eod>"), exported.token_to_id(PAD_TOKEN))
    assert special == (0, 257, 258)
