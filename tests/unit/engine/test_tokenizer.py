from weightsync.engine.tokenizer import ByteTokenizer


def test_round_trip_of_unicode_text():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓ 🤖"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text


def test_specials_are_dropped_or_named():
    tok = ByteTokenizer(add_bos=False)
    ids = [*tok.encode("a"), tok.eos_token_id, *tok.encode("b"), 300]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "a<|eos|>b"


def test_incremental_decoder_holds_back_partial_characters():
    tok = ByteTokenizer()
    decoder = tok.incremental_decoder()
    pieces = [decoder.add(i) for i in "a🤖b".encode()]
    assert pieces == ["a", "", "", "", "🤖", "b"]
