"""Lightning callbacks for bridge-pl, named in configs as ``callbacks.<Name>``."""
