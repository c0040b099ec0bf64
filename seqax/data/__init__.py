"""The data path: the flat-tokens dataset format, the tokenizers, the loader's batches and the evaluation's
batches and task files."""
