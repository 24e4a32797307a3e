import FastdiagProofs

/-!
Optional extra check, run after `lake build`:

    lake env lean AxiomCheck.lean

Each line should report only Lean's standard foundations
(`propext`, `Classical.choice`, `Quot.sound`); anything else (in particular `sorryAx`)
means a proof is incomplete.
-/

#print axioms FastdiagProofs.cosine_mem_Icc
#print axioms FastdiagProofs.cosine_eq_one_iff
#print axioms FastdiagProofs.cosine_eq_one_iff_eq
#print axioms FastdiagProofs.sync_mem_Icc
#print axioms FastdiagProofs.sync_eq_one_iff
#print axioms FastdiagProofs.entropy_mem_Icc
#print axioms FastdiagProofs.entropy_le_log_card_of_support
#print axioms FastdiagProofs.popStd_eq_zero_iff
#print axioms FastdiagProofs.popStd_le_half_range
#print axioms FastdiagProofs.entropySpread_le_half_log_card
#print axioms FastdiagProofs.entropySpread_eq_zero_of_forall_eq
#print axioms FastdiagProofs.ofRows_append
#print axioms FastdiagProofs.gramOn_union
#print axioms FastdiagProofs.cosine_flatten_eq_gram
