"""seqax's machinery, below train.py: configuration, sharded types and collectives (shardlib), attention
kernels, data, checkpoints, multi-host start-up, and what a run reports. docs/layout.md maps the modules;
imports run one way: config imports nothing of ours, the rest import config and shardlib, train.py imports
the package, and nothing here imports train.py."""
