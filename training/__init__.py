"""MQAR (associative recall): the task generator, training of small hybrids, and evaluation through the engine."""
