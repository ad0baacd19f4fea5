import subprocess
import sys

import pytest

from hybridkv.core.hashing import MultiModalFeature, get_hash_fn, hash_block_tokens, seed_hash
from hybridkv.core.request import BlockHasher, Request
from hybridkv.errors import InvalidConfigError


def hashes_of(tokens, bs=4, algo="sha256", **extra):
    return Request("r", tokens, hasher=BlockHasher(bs, algo), **extra).block_hashes


def test_only_full_blocks_are_hashed():
    assert len(hashes_of(list(range(3)))) == 0
    assert len(hashes_of(list(range(4)))) == 1
    assert len(hashes_of(list(range(10)))) == 2


def test_chain_matches_manual_computation():
    fn = get_hash_fn("sha256")
    h0 = hash_block_tokens(fn, seed_hash(fn), [0, 1, 2, 3])
    h1 = hash_block_tokens(fn, h0, [4, 5, 6, 7])
    assert hashes_of(list(range(9))) == [h0, h1]


def test_hash_names_the_whole_prefix():
    a = hashes_of([1, 2, 3, 4, 5, 6, 7, 8])
    b = hashes_of([9, 2, 3, 4, 5, 6, 7, 8])  # same second block, different first
    assert a[1] != b[1]
    assert hashes_of([1, 2, 3, 4, 0, 0, 0, 0])[0] == a[0]


def test_extra_keys_lora_every_block_salt_first_block():
    plain = hashes_of(list(range(8)))
    lora = hashes_of(list(range(8)), lora_name="adapter")
    assert lora[0] != plain[0] and lora[1] != plain[1]
    salted = hashes_of(list(range(8)), cache_salt="tenant-a")
    assert salted[0] != plain[0]
    assert salted != hashes_of(list(range(8)), cache_salt="tenant-b")
    r = Request("r", list(range(8)), hasher=BlockHasher(4), cache_salt="s")
    assert r.extra_keys(0, 4) == (("salt", "s"),) and r.extra_keys(1, 4) is None


def test_multimodal_hash_applies_to_overlapping_blocks():
    img = MultiModalFeature(offset=5, length=4, identifier="img-1")  # tokens 5..8 -> blocks 1, 2
    plain = hashes_of(list(range(12)))
    with_img = hashes_of(list(range(12)), mm_features=[img])
    assert with_img[0] == plain[0]
    assert with_img[1] != plain[1]
    other = hashes_of(list(range(12)), mm_features=[MultiModalFeature(5, 4, "img-2")])
    assert other[1] != with_img[1]


def test_appending_completes_blocks():
    r = Request("r", list(range(6)), hasher=BlockHasher(4))
    assert len(r.block_hashes) == 1
    r.append_token_ids(6)
    assert len(r.block_hashes) == 1
    r.append_token_ids([7, 8, 9, 10, 11])
    assert r.block_hashes == hashes_of(list(range(12)))


def test_xxhash_option_differs_from_sha256_and_is_stable():
    pytest.importorskip("xxhash")
    x = hashes_of(list(range(8)), algo="xxhash")
    assert x == hashes_of(list(range(8)), algo="xxhash")
    assert x != hashes_of(list(range(8)))
    assert len(x[0]) == 16


def test_unknown_algorithm_is_a_config_error():
    with pytest.raises(InvalidConfigError):
        get_hash_fn("md5")


def test_hashes_are_stable_across_processes():
    code = (
        "from hybridkv.core.request import Request, BlockHasher;"
        "print(Request('r', list(range(8)), hasher=BlockHasher(4), lora_name='x').block_hashes[1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert out == hashes_of(list(range(8)), lora_name="x")[1].hex()
