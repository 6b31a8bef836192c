"""Protocol definitions of the KV link (generated stubs live beside the .proto)."""
