"""The OpenAI Batch API on the job queue: a batch's lines run as ordinary jobs at the batch priority.

``models`` holds the OpenAI shapes, ``validation`` turns an input file into job submissions (through the same
checks as the chat and completions endpoints), ``store`` keeps a batch's state in Redis and ``runner`` advances
active batches from any API replica, under a lease: it submits lines, records each line's result once, and
writes the output and error files when every line has one.
"""
