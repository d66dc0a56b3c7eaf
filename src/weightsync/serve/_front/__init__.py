"""The data-parallel front (`weightsync serve --data-parallel-size N`): one server over N replicas.

Not on the path of one update: imported only when a front or a replica of one starts. The rules
of an update live once, in each replica's engine; the front fans calls out and answers in.
"""
