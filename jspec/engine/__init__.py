"""One round of speculative decoding, all inside one jitted while loop (loop): the loop/drafter
contract (state), the widths a verification runs at (width), the acceptance rules (acceptance)
and sampling (sampling)."""
