"""The bottom layer: typed data that crosses stage boundaries, the errors, and the Protocols at
the seams the RL loop drives. Imports nothing else of treadle."""
