"""torchcache with real models: Hugging Face, torchvision-style and timm-style networks, torch.compile, training loops.

Every recipe of docs/models.md is backed by a test here. Models are tiny and built
from random configurations (no downloads). The torchvision-style and timm-style
models are written here in the style of those libraries (conv/bn/relu blocks; a
``create_model`` factory whose models have ``forward_features``).
"""

from __future__ import annotations

import copy
import json
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchcache import CacheWarning, ConfigError, KeyingError, torchcache
from torchcache.keys import encode_value

from .helpers import run_python

# Importing torch's inductor backend (the default of torch.compile) imports
# torch.utils.mkldnn, whose torch.jit.script_method is deprecated: torch itself warns.
_INDUCTOR_IMPORT = "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"


# -- Hugging Face configurations ------------------------------------------------------------------------
BERT = {
    "vocab_size": 100,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
}
VIT = {
    "image_size": 32,
    "patch_size": 8,
    "num_channels": 3,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
CLIP_TEXT = {
    "vocab_size": 100,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 16,
    # The defaults (49406, 49407) are outside a vocabulary of 100.
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 1,
}
CLIP_VISION = {
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}


def _transformers() -> Any:
    return pytest.importorskip("transformers", reason="the Hugging Face recipes need transformers")


def _tokens(batch: int = 4, length: int = 10, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 100, (batch, length), generator=generator),
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
        "token_type_ids": torch.zeros(batch, length, dtype=torch.long),
    }


def _images(batch: int = 3, size: int = 32, seed: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _assert_outputs_equal(got: Any, want: Any) -> None:
    """Same type, same keys, every tensor equal (``None`` fields included)."""
    assert type(got) is type(want), (type(got), type(want))
    assert list(got.keys()) == list(want.keys())
    for key in want:
        value, expected = got[key], want[key]
        if isinstance(expected, tuple):
            assert len(value) == len(expected)
            assert all(torch.equal(a, b) for a, b in zip(value, expected))
        else:
            assert torch.equal(value, expected), key


def _image_features(output: Any) -> torch.Tensor:
    """``get_image_features`` returns a tensor (transformers 4) or an output whose pooler_output it is (5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


# -- 1. a Hugging Face class, subclassed and decorated ---------------------------------------------------
def test_hf_bert_subclass_decorated_as_a_class() -> None:
    transformers = _transformers()
    from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions as BertOutput

    @torchcache()
    class FrozenBert(transformers.BertModel):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.requires_grad_(False)
            self.eval()  # a model built from a config starts in training mode (dropout on)

    config = transformers.BertConfig(**BERT)
    model = FrozenBert(config)
    plain = transformers.BertModel(config).eval()
    plain.load_state_dict(model.state_dict())
    batch = _tokens()

    first = model(**batch)
    second = model(**batch)
    stats = model.cache_instance.stats()
    assert (stats.hits, stats.misses) == (4, 4)
    want = plain(**batch)
    _assert_outputs_equal(first, want)
    _assert_outputs_equal(second, want)
    assert type(second) is BertOutput
    assert torch.equal(second.last_hidden_state, want.last_hidden_state)
    assert torch.equal(second.pooler_output, want.pooler_output)
    assert second.hidden_states is None and second.attentions is None
    assert torch.equal(second[0], want[0]) and torch.equal(second.to_tuple()[1], want.to_tuple()[1])

    # Another attention mask is another key: computed, not served from the first call.
    masked = dict(batch, attention_mask=batch["attention_mask"].clone())
    masked["attention_mask"][:, -3:] = 0
    got = model(**masked)
    assert model.cache_instance.stats().misses == 8
    _assert_outputs_equal(got, plain(**masked))
    assert not torch.equal(got.last_hidden_state, second.last_hidden_state)

    # One item's mask changed: only that item is computed again.
    one = dict(batch, attention_mask=batch["attention_mask"].clone())
    one["attention_mask"][2, -1] = 0
    got = model(**one)
    stats = model.cache_instance.stats()
    assert (stats.hits, stats.misses) == (4 + 3, 8 + 1)
    want = plain(**one)
    assert torch.allclose(got.last_hidden_state, want.last_hidden_state, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.last_hidden_state[[0, 1, 3]], second.last_hidden_state[[0, 1, 3]])

    # return_dict=False is part of the key: a plain tuple, cached on its own.
    as_tuple = model(**batch, return_dict=False)
    assert type(as_tuple) is tuple and torch.equal(as_tuple[0], second.last_hidden_state)
    assert model.cache_instance.stats().misses == 9 + 4
    assert type(model(**batch, return_dict=False)) is tuple


# -- 2. a Hugging Face instance, wrapped -------------------------------------------------------------------
def test_hf_vit_instance_wrap_leaves_the_class_and_other_instances_alone(tmp_path: Path) -> None:
    transformers = _transformers()
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    forward_before = transformers.ViTModel.forward
    config = transformers.ViTConfig(**VIT)
    model = transformers.ViTModel(config).eval().requires_grad_(False)
    plain = transformers.ViTModel(config).eval().requires_grad_(False)
    plain.load_state_dict(model.state_dict())
    keys, text = list(model.state_dict()), repr(model)

    assert torchcache()(model) is model
    assert isinstance(model, transformers.ViTModel) and type(model).__name__ == "ViTModel"
    assert list(model.state_dict()) == keys == list(plain.state_dict())
    assert repr(model) == text
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert torchcache()(model).cache_instance is model.cache_instance  # wrapping again: the same cache
    with pytest.raises(ConfigError, match="already cached with other settings"):
        torchcache(persistent=True)(model)
    # The class and every other instance are untouched.
    assert transformers.ViTModel.forward is forward_before
    assert type(plain) is transformers.ViTModel and not hasattr(plain, "cache_instance")

    images = _images()
    want = plain(pixel_values=images)
    first = model(pixel_values=images)
    second = model(images)  # positional or keyword: one key
    stats = model.cache_instance.stats()
    assert (stats.hits, stats.misses) == (3, 3)
    _assert_outputs_equal(first, want)
    _assert_outputs_equal(second, want)
    assert type(second) is BaseModelOutputWithPooling
    assert torch.equal(second.pooler_output, want.pooler_output)
    assert torch.equal(second["last_hidden_state"], want.last_hidden_state)

    # output_hidden_states=True: another key, with a tuple of hidden states per item.
    hidden = model(images, output_hidden_states=True)  # transformers adds its capturing hooks as this runs:
    again = model(images, output_hidden_states=True)  # rows made while they came are not stored, so computed again
    assert model.cache_instance.stats().misses == 9
    assert torch.equal(model(images, output_hidden_states=True).last_hidden_state, again.last_hidden_state)
    assert model.cache_instance.stats().misses == 9  # then hits
    _assert_outputs_equal(again, plain(images, output_hidden_states=True))
    assert len(again.hidden_states) == VIT["num_hidden_layers"] + 1
    assert all(torch.equal(a, b) for a, b in zip(hidden.hidden_states, again.hidden_states))

    # save_pretrained writes the plain model, which loads as a plain ViTModel.
    model.save_pretrained(tmp_path / "vit")
    assert json.loads((tmp_path / "vit" / "config.json").read_text())["architectures"] == ["ViTModel"]
    reloaded = transformers.ViTModel.from_pretrained(tmp_path / "vit")
    assert type(reloaded) is transformers.ViTModel and "cache_instance" not in reloaded.__dict__
    _assert_outputs_equal(reloaded(images), want)

    # A new ViTModel is a plain, trainable model.
    student = transformers.ViTModel(config)
    assert type(student) is transformers.ViTModel and "cache_instance" not in student.__dict__
    before = student.pooler.dense.weight.detach().clone()
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    student(images).pooler_output.square().mean().backward()
    optimizer.step()
    assert not torch.equal(student.pooler.dense.weight, before)

    # A model that is not frozen is refused: its parameters could not be trained through the cache.
    with pytest.raises(ConfigError, match="require grad"):
        torchcache()(student)
    assert type(student) is transformers.ViTModel


CHILD_VIT = """
import json, sys
import torch
import transformers
from torchcache import torchcache

config = transformers.ViTConfig(**json.loads(sys.argv[1]))
torch.manual_seed(0)
model = transformers.ViTModel(config).eval().requires_grad_(False)
torchcache(persistent=True)(model)
out = model(torch.load(sys.argv[2]))
want = torch.load(sys.argv[3], weights_only=False)
stats = model.cache_instance.stats()
print(json.dumps({
    "hits": stats.hits, "misses": stats.misses, "disk_hits": stats.disk.hits,
    "type": type(out).__name__,
    "equal": all(torch.equal(out[k], want[k]) for k in want.keys()) and list(out.keys()) == list(want.keys()),
}))
"""


@pytest.mark.slow
def test_hf_vit_instance_hits_across_processes(tmp_path: Path) -> None:
    transformers = _transformers()
    config = transformers.ViTConfig(**VIT)
    torch.manual_seed(0)
    model = transformers.ViTModel(config).eval().requires_grad_(False)
    torchcache(persistent=True)(model)
    images = _images(batch=5)
    out = model(images)
    model.cache_instance.flush()
    assert model.cache_instance.stats().disk.entries == 5
    torch.save(images, tmp_path / "images.pt")
    torch.save(out, tmp_path / "out.pt")

    result = run_python(CHILD_VIT, json.dumps(VIT), str(tmp_path / "images.pt"), str(tmp_path / "out.pt"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"hits": 5, "misses": 0, "disk_hits": 5, "type": "BaseModelOutputWithPooling", "equal": True}


# -- 3. from_pretrained -------------------------------------------------------------------------------------
def test_hf_from_pretrained_then_freeze_then_wrap(tmp_path: Path) -> None:
    transformers = _transformers()
    source = transformers.BertModel(transformers.BertConfig(**BERT)).eval()
    source.save_pretrained(tmp_path / "bert")
    saved = {k: v.clone() for k, v in source.state_dict().items()}

    model = transformers.AutoModel.from_pretrained(tmp_path / "bert").requires_grad_(False)
    assert not model.training  # from_pretrained returns a model in eval mode
    torchcache()(model)
    loaded = model.state_dict()
    assert list(loaded) == list(saved)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)

    batch = _tokens()
    want = source(**batch)
    _assert_outputs_equal(model(**batch), want)
    _assert_outputs_equal(model(**batch), want)
    assert model.cache_instance.stats().hits == 4


def test_one_checkpoint_loaded_from_two_places_has_one_key(tmp_path: Path) -> None:
    transformers = _transformers()
    source = transformers.BertModel(transformers.BertConfig(**BERT)).eval()
    source.save_pretrained(tmp_path / "here")
    source.save_pretrained(tmp_path / "there")
    keys = []
    for place in ("here", "there"):
        model = transformers.AutoModel.from_pretrained(tmp_path / place).requires_grad_(False)
        keys.append(torchcache()(model).cache_instance.module_hash)
    assert keys[0] == keys[1]
    other = transformers.AutoModel.from_pretrained(tmp_path / "here").requires_grad_(False)
    with torch.no_grad():
        other.pooler.dense.bias.add_(1)  # other weights: another key
    assert torchcache()(other).cache_instance.module_hash != keys[0]


def test_hf_decorated_class_from_pretrained_is_frozen_again_after_loading(tmp_path: Path) -> None:
    transformers = _transformers()

    @torchcache()
    class FrozenBert(transformers.BertModel):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.requires_grad_(False)

    source = transformers.BertModel(transformers.BertConfig(**BERT)).eval()
    source.save_pretrained(tmp_path / "bert")
    model = FrozenBert.from_pretrained(tmp_path / "bert")
    batch = _tokens()
    # from_pretrained loads the checkpoint into new parameters, which require grad again.
    assert any(p.requires_grad for p in model.parameters())
    with pytest.raises(ConfigError, match="require grad"):
        model(**batch)
    model.requires_grad_(False)
    want = source(**batch)
    _assert_outputs_equal(model(**batch), want)
    _assert_outputs_equal(model(**batch), want)
    assert (model.cache_instance.stats().hits, model.cache_instance.stats().misses) == (4, 4)
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())


# -- 4. a method: CLIP get_image_features ---------------------------------------------------------------------
def _clip(seed: int) -> Any:
    transformers = _transformers()
    config = transformers.CLIPConfig(text_config=CLIP_TEXT, vision_config=CLIP_VISION, projection_dim=16)
    torch.manual_seed(seed)
    return transformers.CLIPModel(config).eval().requires_grad_(False)


def test_clip_get_image_features_as_a_bound_method(cache_root: Path) -> None:
    clip = _clip(seed=0)
    image_features = torchcache(persistent=True)(clip.get_image_features)
    text_features = torchcache(persistent=True)(clip.get_text_features)
    images = _images()
    want = _image_features(clip.get_image_features(pixel_values=images))

    first = _image_features(image_features(pixel_values=images))
    second = _image_features(image_features(images))
    assert (image_features.cache_instance.stats().hits, image_features.cache_instance.stats().misses) == (3, 3)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert first.shape == (3, 16)

    tokens = _tokens(batch=3, length=8)
    del tokens["token_type_ids"]
    text_want = _image_features(clip.get_text_features(**tokens))
    assert torch.equal(_image_features(text_features(**tokens)), text_want)
    assert torch.equal(_image_features(text_features(**tokens)), text_want)
    assert text_features.cache_instance.stats().hits == 3
    assert text_features.cache_instance.module_hash != image_features.cache_instance.module_hash

    # Another CLIP model (other weights), same cache directory: its own key, its own outputs.
    other = _clip(seed=1)
    other_features = torchcache(persistent=True)(other.get_image_features)
    assert other_features.cache_instance.module_hash != image_features.cache_instance.module_hash
    got = _image_features(other_features(images))
    assert other_features.cache_instance.stats().misses == 3 and other_features.cache_instance.stats().hits == 0
    assert torch.equal(got, _image_features(other.get_image_features(pixel_values=images)))
    assert not torch.equal(got, want)
    image_features.cache_instance.flush()
    other_features.cache_instance.flush()
    assert image_features.cache_instance.cache_dir != other_features.cache_instance.cache_dir
    assert image_features.cache_instance.cache_dir.parent == cache_root


def test_a_whole_clip_model_is_refused_and_names_its_feature_methods() -> None:
    clip = torchcache()(_clip(seed=0))
    tokens = _tokens(batch=3, length=8)
    del tokens["token_type_ids"]
    with pytest.raises(KeyingError, match="get_image_features"):  # logits_per_image: every image by every text
        clip(pixel_values=_images(), **tokens)


WHISPER = {
    "vocab_size": 100,
    "num_mel_bins": 8,
    "encoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_layers": 1,
    "decoder_attention_heads": 2,
    "d_model": 16,
    "encoder_ffn_dim": 32,
    "decoder_ffn_dim": 32,
    "max_source_positions": 16,
    "max_target_positions": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
}


def test_whisper_encoder_is_cached_bit_for_bit_and_the_whole_model_names_the_way_out() -> None:
    transformers = _transformers()
    torch.manual_seed(0)
    whisper = transformers.WhisperModel(transformers.WhisperConfig(**WHISPER)).eval().requires_grad_(False)
    features = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(4))
    want = whisper.encoder(features)
    encoder = torchcache()(whisper.get_encoder())
    _assert_outputs_equal(encoder(features), want)
    _assert_outputs_equal(encoder(features), want)
    assert encoder.cache_instance.stats().hits == 3
    model = torchcache()(whisper)
    with pytest.raises(KeyingError, match=r"use_cache=False.*encoder"):
        model(input_features=features, decoder_input_ids=torch.ones(3, 2, dtype=torch.long))


def test_sentence_transformers_cache_the_inner_model_and_the_whole_model_names_it(tmp_path: Path) -> None:
    transformers = _transformers()
    st = pytest.importorskip("sentence_transformers", reason="needs sentence-transformers")
    try:
        import sentence_transformers.sentence_transformer.modules as st_models  # 6 and later
    except ImportError:  # pragma: no cover - older releases
        import sentence_transformers.models as st_models
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(chr(c) for c in range(97, 123)), "hello", "cat", "dog"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab))
    torch.manual_seed(0)
    config = transformers.BertConfig(**{**BERT, "vocab_size": len(vocab)})
    transformers.BertModel(config).save_pretrained(tmp_path)
    transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)

    def encoder() -> Any:
        word = st_models.Transformer(str(tmp_path))
        pooling = st_models.Pooling(BERT["hidden_size"])
        return st.SentenceTransformer(modules=[word, pooling], device="cpu").eval().requires_grad_(False)

    sentences = ["hello dog", "cat", "dog dog cat", "hello"]
    model = encoder()
    want = model.encode(sentences, convert_to_tensor=True)
    torchcache()(model[0].auto_model)  # the transformer inside: per-item outputs
    assert torch.equal(model.encode(sentences, convert_to_tensor=True), want)
    assert torch.equal(model.encode(sentences, convert_to_tensor=True), want)
    assert model[0].auto_model.cache_instance.stats().hits == len(sentences)
    whole = torchcache()(encoder())  # its forward returns the tokenizer's BatchEncoding
    with pytest.raises(KeyingError, match=r"model\[0\]\.auto_model"):
        whole.encode(sentences, convert_to_tensor=True)


# -- 5. torchvision-style and timm-style models ------------------------------------------------------------
class BasicBlock(nn.Module):
    """A torchvision-style residual block: conv-bn-relu-conv-bn, plus a projected shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class TinyResNet(nn.Module):
    """A torchvision-style ResNet: stem, residual stages, global average pool, ``fc``."""

    def __init__(self, num_classes: int = 10, width: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * width, num_classes)
        with torch.no_grad():  # running statistics as after training, so eval mode matters
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(self.dropout(x))


def resnet_tiny(num_classes: int = 10, **kwargs: Any) -> TinyResNet:
    """A model factory in the style of ``torchvision.models.resnet18(weights=...)``."""
    return TinyResNet(num_classes=num_classes, **kwargs)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) / math.sqrt(c // self.num_heads)).softmax(dim=-1)
        return self.proj_drop(self.proj((attn @ v).transpose(1, 2).reshape(b, n, c)))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """A timm-style ViT: ``forward_features`` gives tokens, ``forward_head`` pools and classifies."""

    def __init__(
        self,
        img_size: int = 32,
        patch_size: int = 8,
        embed_dim: int = 32,
        depth: int = 2,
        num_classes: int = 10,
        drop_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.patch_embed = nn.Conv2d(3, embed_dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (img_size // patch_size) ** 2 + 1, embed_dim) * 0.02)
        self.pos_drop = nn.Dropout(drop_rate)
        self.blocks = nn.Sequential(*(Block(embed_dim, num_heads=2) for _ in range(depth)))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.norm(self.blocks(self.pos_drop(x)))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, 0]
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


_MODELS: dict[str, Callable[..., nn.Module]] = {
    "tiny_vit": lambda **kwargs: VisionTransformer(embed_dim=32, depth=2, **kwargs),
}


def create_model(name: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """A model registry in the style of ``timm.create_model``."""
    return _MODELS[name](**kwargs)


def test_torchvision_style_cnn_with_batch_norm_as_an_instance() -> None:
    model = resnet_tiny().eval().requires_grad_(False)
    plain = resnet_tiny().eval().requires_grad_(False)
    plain.load_state_dict(model.state_dict())
    torchcache()(model)
    images = _images(batch=6, size=16)
    want = plain(images)
    assert torch.equal(model(images), want)
    assert torch.equal(model(images), want)
    assert model.cache_instance.stats().hits == 6
    assert type(plain) is TinyResNet and "cache_instance" not in plain.__dict__
    # Batch norm uses its running statistics: in training mode it would not, and torchcache says so.
    model.train()
    with pytest.warns(CacheWarning, match="training mode"):
        model(images)


def test_torchvision_style_feature_extractor_with_the_classifier_removed() -> None:
    model = resnet_tiny().eval().requires_grad_(False)
    plain = copy.deepcopy(model)
    torchcache()(model)
    model.fc = nn.Identity()  # before the first call: the key is taken then, from the weights it has
    plain.fc = nn.Identity()
    images = _images(batch=3, size=16)
    assert model(images).shape == (3, 16)
    assert torch.equal(model(images), plain(images))
    assert model.cache_instance.stats().hits == 3


def test_timm_style_model_and_its_forward_features() -> None:
    model = create_model("tiny_vit", pretrained=False).eval().requires_grad_(False)
    plain = create_model("tiny_vit").eval().requires_grad_(False)
    plain.load_state_dict(model.state_dict())

    features = torchcache()(model.forward_features)
    torchcache()(model)
    images = _images(batch=4)
    want_features, want_logits = plain.forward_features(images), plain(images)

    assert torch.equal(features(images), want_features)
    assert torch.equal(features(images), want_features)
    assert features.cache_instance.stats().hits == 4
    assert features(images).shape == (4, 17, 32)
    assert torch.equal(model(images), want_logits)
    assert torch.equal(model(images), want_logits)
    assert model.cache_instance.stats().hits == 4
    assert features.cache_instance.module_hash != model.cache_instance.module_hash
    # The method's cache stays with the method: forward_features called directly is not cached.
    assert torch.equal(model.forward_features(images), want_features)
    assert features.cache_instance.stats().hits == 8
    # A cached head on the cached features (pre_logits is part of the key).
    head = torchcache()(model.forward_head)
    pooled = head(features(images), pre_logits=True)
    assert torch.equal(pooled, want_features[:, 0])
    assert torch.equal(head(features(images)), want_logits)
    assert head.cache_instance.stats().misses == 8
    assert type(create_model("tiny_vit")) is VisionTransformer


def test_cached_method_of_a_model_in_training_mode_warns() -> None:
    # timm's create_model returns a model in training mode; its dropout would be replayed by the cache.
    model = create_model("tiny_vit", drop_rate=0.5).requires_grad_(False)
    assert model.training
    features = torchcache()(model.forward_features)
    with pytest.warns(CacheWarning, match="training mode"):
        features(_images(batch=2))


def test_keep_eval_with_a_cached_method_is_honoured_or_refused() -> None:
    model = create_model("tiny_vit", drop_rate=0.5).requires_grad_(False)
    try:
        features = torchcache(keep_eval=True)(model.forward_features)
    except ConfigError:
        return  # refused: the option has no effect on a method
    model.train()
    assert not model.training, "keep_eval=True was accepted for a method but the model stays in training mode"
    images = _images(batch=2)
    assert torch.equal(features(images), model.eval().forward_features(images))


# -- 6. a training loop with a cached frozen backbone ---------------------------------------------------------
class Classifier(nn.Module):
    """A LightningModule-style model: a frozen backbone, a trainable head, ``training_step``."""

    def __init__(self, backbone: nn.Module, num_classes: int = 3, freeze_backbone_mode: bool = False) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(10, num_classes)
        self.freeze_backbone_mode = freeze_backbone_mode

    def on_train_epoch_start(self) -> None:
        if self.freeze_backbone_mode:  # what one writes without keep_eval
            self.backbone.eval()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.head(self.backbone(images)), labels)


def _batches(count: int = 3, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randn(batch, 3, 16, 16, generator=generator), torch.randint(0, 3, (batch,), generator=generator))
        for _ in range(count)
    ]


def _fit(model: Classifier, batches: list[tuple[torch.Tensor, torch.Tensor]], epochs: int = 3) -> list[torch.Tensor]:
    """A Lightning-style fit loop: ``model.train()`` at the top of every epoch."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    losses = []
    for _ in range(epochs):
        model.train()
        model.on_train_epoch_start()
        assert model.head.training
        for batch in batches:
            optimizer.zero_grad()
            loss = model.training_step(batch)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    return losses


def _backbone_pair(dropout: float) -> tuple[nn.Module, nn.Module]:
    backbone = resnet_tiny(dropout=dropout).requires_grad_(False)
    plain = copy.deepcopy(backbone)
    return backbone, plain


def test_training_loop_with_keep_eval_matches_the_loop_without_the_cache() -> None:
    backbone, plain = _backbone_pair(dropout=0.5)
    torchcache(keep_eval=True)(backbone)
    assert not backbone.training  # keep_eval puts it in eval mode at once
    torch.manual_seed(5)
    cached_model = Classifier(backbone)
    reference = copy.deepcopy(cached_model.head)
    uncached_model = Classifier(plain, freeze_backbone_mode=True)
    uncached_model.head.load_state_dict(reference.state_dict())
    batches = _batches()

    with_cache = _fit(cached_model, batches)  # warnings are errors here: a CacheWarning would fail
    assert not any(m.training for m in backbone.modules())
    without_cache = _fit(uncached_model, batches)

    assert len(with_cache) == len(without_cache) == 9
    assert all(torch.equal(a, b) for a, b in zip(with_cache, without_cache))
    assert torch.equal(cached_model.head.weight, uncached_model.head.weight)
    assert torch.equal(cached_model.head.bias, uncached_model.head.bias)
    assert not torch.equal(cached_model.head.weight, reference.weight)  # it trained
    stats = backbone.cache_instance.stats()
    assert (stats.hits, stats.misses) == (24, 12)

    # Without keep_eval, backbone.eval() at the start of each epoch does the same, without a warning.
    manual = copy.deepcopy(plain)
    torchcache()(manual)
    manual_model = Classifier(manual, freeze_backbone_mode=True)
    manual_model.head.load_state_dict(reference.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_fit(manual_model, batches), without_cache))
    assert torch.equal(manual_model.head.weight, uncached_model.head.weight)
    assert manual.cache_instance.stats().hits == 24


def test_training_loop_without_keep_eval_warns_once_about_training_mode() -> None:
    backbone, _ = _backbone_pair(dropout=0.5)
    torchcache()(backbone)
    model = Classifier(backbone)
    with pytest.warns(CacheWarning, match="training mode") as record:
        _fit(model, _batches())
    assert sum(issubclass(w.category, CacheWarning) for w in record) == 1
    assert backbone.training


def test_training_mode_warning_points_at_the_callers_line() -> None:
    backbone = torchcache()(resnet_tiny(dropout=0.5).requires_grad_(False))
    with pytest.warns(CacheWarning, match="training mode") as record:
        backbone(_images(batch=2, size=16))
    assert record[0].filename == __file__, f"the warning points at {record[0].filename}:{record[0].lineno}"


# -- 7. torch.compile ---------------------------------------------------------------------------------------
@pytest.fixture
def dynamo() -> Iterator[Any]:
    import torch._dynamo

    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10)).requires_grad_(False)


@pytest.mark.filterwarnings(_INDUCTOR_IMPORT)
def test_compiled_model_with_a_cached_backbone_and_a_trained_head(dynamo: Any) -> None:
    backbone = _mlp(seed=0)
    torch.manual_seed(1)
    head = nn.Linear(10, 3)
    reference = nn.Sequential(copy.deepcopy(backbone), copy.deepcopy(head))
    torchcache()(backbone)
    compiled = torch.compile(nn.Sequential(backbone, head))
    x, target = torch.randn(5, 6), torch.randn(5, 3)

    for step in range(3):
        head.zero_grad()
        reference.zero_grad()
        out = compiled(x)
        F.mse_loss(out, target).backward()
        want = reference(x)
        F.mse_loss(want, target).backward()
        assert backbone.cache_instance.stats().hits == 5 * step
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(head.weight.grad, reference[1].weight.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(head.bias.grad, reference[1].bias.grad, rtol=1e-6, atol=1e-6)
    assert backbone.cache_instance.stats().misses == 5


@pytest.mark.slow
@pytest.mark.filterwarnings(_INDUCTOR_IMPORT)
def test_compiled_cached_backbone_referenced_elsewhere(dynamo: Any) -> None:
    backbone = torchcache()(_mlp(seed=0))
    plain = _mlp(seed=0)
    keep = [backbone]
    other = nn.Sequential(backbone, nn.ReLU())
    compiled = torch.compile(backbone)
    x = torch.randn(4, 6)
    want = plain(x)

    torch.testing.assert_close(compiled(x), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(compiled(x), keep[0](x))
    assert torch.equal(other(x), keep[0](x).relu())
    stats = backbone.cache_instance.stats()
    assert (stats.hits, stats.misses) == (16, 4)
    # nn.Module.compile() compiles in place: the same object, still cached.
    backbone.compile()
    assert torch.equal(backbone(x), keep[0](x))
    assert backbone.cache_instance.stats().hits == 24
    # A compiled function that calls a cached method (inductor's kernels for the pooling would
    # take a cold compile of 15 s here and test nothing of the cache's: aot_eager traces alike).
    model = create_model("tiny_vit").eval().requires_grad_(False)
    features = torchcache()(model.forward_features)
    pooled = torch.compile(lambda images: features(images).mean(dim=1), backend="aot_eager")
    images = _images(batch=2)
    torch.testing.assert_close(pooled(images), model.forward_features(images).mean(dim=1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pooled(images), model.forward_features(images).mean(dim=1), rtol=1e-6, atol=1e-6)
    assert (features.cache_instance.stats().hits, features.cache_instance.stats().misses) == (2, 2)


@pytest.mark.filterwarnings(_INDUCTOR_IMPORT)
def test_fullgraph_compile_cannot_include_a_cached_module(dynamo: Any) -> None:
    backbone = torchcache()(_mlp(seed=0))
    compiled = torch.compile(nn.Sequential(backbone, nn.Linear(10, 2)), fullgraph=True)
    with pytest.raises(dynamo.exc.Unsupported, match=r"torch.compiler.disable"):
        compiled(torch.randn(3, 6))
    assert backbone.cache_instance.stats().hits + backbone.cache_instance.stats().misses == 0
    # Compiling only what follows the cached module with fullgraph=True works.
    head = torch.compile(nn.Linear(10, 2), fullgraph=True)
    x = torch.randn(3, 6)
    assert head(backbone(x)).shape == (3, 2)
    assert head(backbone(x)).shape == (3, 2)
    assert backbone.cache_instance.stats().hits == 3


def test_a_compiled_module_is_refused_with_the_order_that_caches(dynamo: Any) -> None:
    compiled = torch.compile(_mlp(seed=0), backend="eager")
    with pytest.raises(ConfigError, match=r"torch.compile\(\) cannot be cached itself: wrap the module, then compile"):
        torchcache()(compiled)
    assert "cache_instance" not in vars(compiled) and "cache_instance" not in vars(compiled._orig_mod)


# -- 8. copies: EMA and teacher-student ------------------------------------------------------------------------
def test_deepcopy_of_a_model_holding_a_cached_backbone() -> None:
    backbone = torchcache()(resnet_tiny().eval().requires_grad_(False))
    student = Classifier(backbone)
    images = _images(batch=4, size=16)
    want = student.backbone(images)
    original = {k: v.clone() for k, v in backbone.state_dict().items()}

    teacher = copy.deepcopy(student)
    copied = teacher.backbone
    assert type(copied) is type(backbone) and copied is not backbone
    assert copied.cache_instance is not backbone.cache_instance
    assert torch.equal(copied(images), want)
    assert torch.equal(copied(images), want)
    assert copied.cache_instance.stats().hits == 4  # the copy's own cache counts the copy's calls
    assert backbone.cache_instance.stats().hits == 0

    # New weights into the copy (an EMA update, a teacher checkpoint): the copy follows them.
    new_state = {k: v * 1.5 if v.is_floating_point() else v for k, v in copied.state_dict().items()}
    teacher.backbone.load_state_dict(new_state)
    plain = resnet_tiny().eval()
    plain.load_state_dict(new_state)
    expected = plain(images)
    got = copied(images)
    assert torch.equal(got, expected) and not torch.equal(got, want)
    assert torch.equal(copied(images), expected)
    # The original keeps its weights and its outputs.
    assert torch.equal(backbone(images), want)
    assert all(torch.equal(v, original[k]) for k, v in backbone.state_dict().items())
    assert not torch.equal(backbone.conv1.weight, copied.conv1.weight)


class Distiller(nn.Module):
    """A student that keeps a cached method of its frozen backbone as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = create_model("tiny_vit").eval().requires_grad_(False)
        self.features = torchcache()(self.backbone.forward_features)
        self.head = nn.Linear(32, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images)[:, 0])


def test_deepcopy_of_a_model_holding_a_cached_method_follows_the_copy() -> None:
    # Without the cache, a deep copy rebinds a bound method to the copied backbone.
    student = Distiller()
    images = _images(batch=2)
    student(images)
    teacher = copy.deepcopy(student)
    new_state = {k: v * 1.5 for k, v in teacher.backbone.state_dict().items()}
    teacher.backbone.load_state_dict(new_state)
    plain = create_model("tiny_vit").eval()
    plain.load_state_dict(new_state)
    torch.testing.assert_close(teacher.features(images), plain.forward_features(images), rtol=1e-6, atol=1e-6)
    assert torch.equal(student.features(images), student.backbone.forward_features(images))


# -- fx graph modules (torchvision's create_feature_extractor returns one) --------------------------------
class _Traced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def _traced() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return torch.fx.symbolic_trace(_Traced()).requires_grad_(False).eval()


def _swap(graph_module: torch.fx.GraphModule, old: Any, new: Any) -> None:
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is old:
            node.target = new


def test_a_wrapped_graph_module_recompiled_after_an_edit_runs_and_is_keyed_by_its_new_code(cache_root: Path) -> None:
    x = torch.randn(3, 4)
    gm = torchcache(persistent=True)(_traced())
    assert torch.equal(gm(x), torch.relu(gm.lin(x))) and torch.equal(gm(x), torch.relu(gm.lin(x)))
    gm.recompile()  # nothing edited: it still runs (fx's call wrapper set on the cached class called itself)
    assert torch.equal(gm(x), torch.relu(gm.lin(x)))
    _swap(gm, torch.relu, torch.sigmoid)
    gm.recompile()
    for _ in range(2):  # the new code, computed then a hit; never the relu entries on disk
        assert torch.equal(gm(x), torch.sigmoid(gm.lin(x)))
    assert gm.cache_instance.stats().hits == 3
    other = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    _swap(other, torch.sigmoid, torch.tanh)
    gm.graph = other.graph  # fx's setter recompiles
    assert torch.equal(gm(x), torch.tanh(gm.lin(x)))


def test_a_deep_copy_of_a_wrapped_graph_module_has_its_own_code_and_cache(cache_root: Path) -> None:
    x = torch.randn(3, 4)
    gm = torchcache()(_traced())
    gm(x)
    copied = copy.deepcopy(gm)
    _swap(copied, torch.relu, torch.tanh)
    copied.recompile()  # the copy's code only, as without the cache (fx gives each copy a class of its own)
    assert torch.equal(copied(x), torch.tanh(copied.lin(x))) and torch.equal(gm(x), torch.relu(gm.lin(x)))
    assert copied.cache_instance is not gm.cache_instance and copied.cache_instance.stats().misses == 3
    assert gm.cache_instance.stats().hits == 3


def test_a_graph_module_class_is_refused_and_names_the_instance_wrap() -> None:
    class Mine(torch.fx.GraphModule):
        pass

    with pytest.raises(ConfigError, match=r"wrap instances instead, torchcache\(\)\(graph_module\)"):
        torchcache()(Mine)


def test_a_lazy_graph_module_is_wrapped_recompiled_and_copied(cache_root: Path) -> None:
    from torch.fx._lazy_graph_module import _LazyGraphModule

    x, traced = torch.randn(3, 4), _traced()
    lazy = torchcache()(_LazyGraphModule(traced, traced.graph))  # its code not generated yet
    assert torch.equal(lazy(x), torch.relu(lazy.lin(x))) and torch.equal(lazy(x), torch.relu(lazy.lin(x)))
    _swap(lazy, torch.relu, torch.sigmoid)
    lazy.recompile()
    assert torch.equal(lazy(x), torch.sigmoid(lazy.lin(x)))
    copied = copy.deepcopy(lazy)
    assert torch.equal(copied(x), torch.sigmoid(copied.lin(x))) and copied.cache_instance is not lazy.cache_instance


def test_a_wrapped_graph_module_pickles_as_fx_does_without_the_cache(cache_root: Path) -> None:
    import io
    import pickle

    torch.manual_seed(0)  # a forward without annotations: fx cannot pickle the code of annotated ones
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).requires_grad_(False).eval()
    x, gm = torch.randn(3, 4), torchcache()(torch.fx.symbolic_trace(model))
    gm(x)
    cache = gm.cache_instance
    (relu,) = [node for node in gm.graph.nodes if node.op == "call_module" and node.target == "1"]
    relu.op, relu.target = "call_function", torch.tanh  # edited, not recompiled: fx pickles the graph's code
    saved = io.BytesIO()
    torch.save(gm, saved)
    saved.seek(0)
    for loaded in (torch.load(saved, weights_only=False), pickle.loads(pickle.dumps(gm))):
        assert "cache_instance" not in vars(loaded) and isinstance(loaded, torch.fx.GraphModule)
        assert torch.equal(loaded(x), torch.tanh(model[0](x)))
    assert gm.cache_instance is cache and torch.equal(gm(x), model(x))  # not recompiled by pickling
    assert cache.stats().hits == 3


@torchcache()
def _halved(x: torch.Tensor) -> torch.Tensor:
    return x / 2


def test_a_model_holding_a_cached_module_traces_to_its_plain_operations(cache_root: Path) -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torchcache()(_Traced().requires_grad_(False).eval())
            self.features = torchcache()(self.body.forward)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) * 2 + self.features(x) + _halved(x)

    x, outer = torch.randn(3, 4), Outer()
    traced = torch.fx.symbolic_trace(outer)
    assert torch.equal(traced(x), outer(x)) and outer.body.cache_instance.stats().misses == 3


def test_wrapped_graph_modules_are_collected_with_their_classes(cache_root: Path) -> None:
    import gc
    import weakref

    classes = []
    for _ in range(3):
        gm = torchcache()(_traced())
        gm(torch.randn(2, 4))
        classes.append(weakref.ref(type(gm).__bases__[0]))  # the class fx made for this instance
        del gm
    gc.collect()
    assert [ref() for ref in classes] == [None] * 3


def test_a_call_begun_before_a_recompile_runs_the_code_it_began_with_and_stores_nothing(cache_root: Path) -> None:
    x, gm = torch.randn(3, 4), torchcache(persistent=True)(_traced())
    gm(torch.randn(2, 4))
    edited: list[bool] = []

    def edit(module: nn.Module, args: Any) -> None:  # runs after the call looked up the forward it runs
        if not edited:
            edited.append(True)
            _swap(module, torch.relu, torch.sigmoid)
            module.recompile()

    handle = gm.register_forward_pre_hook(edit)
    assert torch.equal(gm(x), torch.relu(gm.lin(x)))  # as without the cache: the code the call began with
    handle.remove()
    assert torch.equal(gm(x), torch.sigmoid(gm.lin(x)))  # never the old code's rows under the new code's key
    gm.cache_instance.flush()
    fresh = _traced()
    _swap(fresh, torch.relu, torch.sigmoid)
    fresh.recompile()
    assert torch.equal(torchcache(persistent=True)(fresh)(x), torch.sigmoid(fresh.lin(x)))  # nor on disk


class _Dual(torch.fx.GraphModule):
    """A graph module whose copies need more than fx's arguments (as torchvision's ``DualGraphModule``)."""

    def __init__(self, root: nn.Module, graph: torch.fx.Graph, label: str) -> None:
        super().__init__(root, graph)
        self.label = label

    def __deepcopy__(self, memo: dict[int, Any]) -> _Dual:
        return _Dual(copy.deepcopy(nn.ModuleDict(dict(self.named_children())), memo), self.graph, self.label)


def test_a_graph_module_subclass_is_copied_by_its_own_deepcopy(cache_root: Path) -> None:
    x, traced = torch.randn(3, 4), _traced()
    gm = torchcache()(_Dual(traced, traced.graph, "mine").requires_grad_(False).eval())
    gm(x)
    copied = copy.deepcopy(gm)
    assert isinstance(copied, _Dual) and copied.label == "mine" and copied.cache_instance is not gm.cache_instance
    assert torch.equal(copied(x), gm(x)) and gm.cache_instance.stats().hits == 3


_FIRST_CALL = """
import torch
from torchcache import torchcache
print(torchcache()(torch.nn.Linear(4, 4).requires_grad_(False))(torch.ones(2, 4)).shape)
"""


@pytest.mark.slow
def test_a_first_cached_call_prints_nothing_but_what_the_script_prints(cache_root: Path) -> None:
    done = run_python(_FIRST_CALL)
    assert (done.returncode, done.stdout, done.stderr) == (0, "torch.Size([2, 4])\n", "")


_HOOK_LOCK = threading.Lock()


def test_a_graph_module_is_keyed_by_its_code_not_its_graphs_notes_counters_or_own_hooks(cache_root: Path) -> None:
    x, plain = torch.randn(3, 4), torchcache()(_traced())
    plain(x)
    noted = _traced()
    first = next(iter(noted.graph.nodes))
    noted.graph.erase_node(noted.graph.create_node("call_function", torch.neg, (first,)))  # a name counter moved
    for node in noted.graph.nodes:
        node.meta["note"] = object()  # what a pass noted (torch.export notes FakeTensors): not keyable, not keyed
    noted.recompile()

    def timed(module: nn.Module, args: Any) -> None:  # its own hook runs around the cached forward: not keyed
        with _HOOK_LOCK:
            pass

    noted.register_forward_pre_hook(timed)
    noted = torchcache()(noted)
    assert torch.equal(noted(x), plain(x))
    assert noted.cache_instance.module_hash == plain.cache_instance.module_hash
    _swap(noted, torch.relu, torch.sigmoid)
    noted.recompile()
    noted(x)
    assert noted.cache_instance.module_hash != plain.cache_instance.module_hash


def _lazy_child_model(order: str) -> torch.fx.GraphModule:
    """A graph module calling a lazy one that packs its outputs in a dict by its codegen's spec (keys in ``order``)."""
    import operator

    import torch.utils._pytree as pytree
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output([graph.call_function(torch.add, (x, 1)), graph.call_function(torch.mul, (x, 3))])
    packed = pytree.tree_flatten(dict.fromkeys(order, 0))[1]  # {"a": add, "b": mul} or the other way round
    graph._codegen = _PyTreeCodeGen(_PyTreeInfo(["x"], pytree.tree_flatten(((x,), {}))[1], packed))
    holder = nn.Module()
    holder.child = _LazyGraphModule(nn.Module(), graph)
    outer = torch.fx.Graph()
    y = outer.placeholder("x")
    outer.output(outer.call_function(operator.getitem, (outer.call_module("child", (y,)), "a")))
    return torch.fx.GraphModule(holder, outer).eval()


def test_graphs_of_one_code_that_pack_their_outputs_otherwise_have_their_own_keys(cache_root: Path) -> None:
    x = torch.tensor([[1.0, 2.0]])
    first, second = torchcache()(_lazy_child_model("ab")), torchcache()(_lazy_child_model("ba"))
    assert torch.equal(first(x), x + 1) and torch.equal(second(x), x * 3)
    assert first.cache_instance.module_hash != second.cache_instance.module_hash
    graphs = [_lazy_child_model(order).child.graph for order in ("ab", "ba")]  # the same code, other specs
    assert graphs[0].python_code("self").src == graphs[1].python_code("self").src
    assert encode_value(graphs[0]) != encode_value(graphs[1])  # even before a lazy module keeps its specs


def test_a_node_inside_a_slice_is_keyed_by_its_name_not_its_notes(cache_root: Path) -> None:
    class Half(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, : x.size(1) // 2] * 2

    x = torch.randn(2, 4)
    plain, noted = torch.fx.symbolic_trace(Half()), torch.fx.symbolic_trace(Half())
    for node in noted.graph.nodes:
        node.meta["note"] = object()  # not keyable: keyed, it would refuse the call
    assert torch.equal(torchcache()(noted)(x), torchcache()(plain)(x))
    assert noted.cache_instance.module_hash == plain.cache_instance.module_hash
