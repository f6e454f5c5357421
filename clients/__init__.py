"""Python and terminal clients for a kvfree server (not built yet)."""
