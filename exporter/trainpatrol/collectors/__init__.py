"""The agent's collectors, one file each: each writes its own exposition text (trainpatrol.exposition)
and says when it has something new to write (``changed``)."""
