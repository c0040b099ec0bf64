"""shardlib: sharding written as types, collectives written as spec strings."""
