"""Preprocessing: tokenizer, chat template, request preprocessing and incremental detokenization."""

from dynamo.preprocess.chat_template import ChatTemplate, Message
from dynamo.preprocess.detokenizer import DeltaResult, IncrementalDetokenizer
from dynamo.preprocess.model_dir import (
    ModelDir,
    demo_model_path,
    load_model_dir,
    tokenizer_checksum,
)
from dynamo.preprocess.preprocessor import (
    GenerationParams,
    Prepared,
    Preprocessor,
    Prompt,
    PromptText,
)
from dynamo.preprocess.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "DeltaResult",
    "GenerationParams",
    "IncrementalDetokenizer",
    "Message",
    "ModelDir",
    "Prepared",
    "Preprocessor",
    "Prompt",
    "PromptText",
    "Tokenizer",
    "demo_model_path",
    "load_model_dir",
    "tokenizer_checksum",
]
