"""rendezvous."""
