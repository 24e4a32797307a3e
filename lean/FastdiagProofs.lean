import FastdiagProofs.Basic
import FastdiagProofs.Cosine
import FastdiagProofs.Sync
import FastdiagProofs.Entropy
import FastdiagProofs.Spread
import FastdiagProofs.Additivity
