"""Reading and storing bytes: local files, the HTTP range client and other remote sources, budgets,
write confinement, caches and zstd transport. This floor fetches and stores bytes; ``dduf_plus.format``
above it describes and checks them. Nothing here imports torch or the format layer."""
