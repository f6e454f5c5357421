"""The model wing: configs, the hybrid LM and its mixer layers, loading, presets, and the `StepBatch` every mixer
is handed. Nothing here knows of sessions, scheduling or serving."""
