"""The serving wing: the engine a server runs (`EngineCore`), the handle a front holds of it, and the two drivers
behind that handle (a thread of this process, or a process of its own, with its frames in ipc.py)."""
